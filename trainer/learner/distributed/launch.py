"""Starting the rank processes of a distributed learner and talking to them
(``learner.backend_settings.launch``: :class:`~trainer.learner.backend_settings.DistributedSettings`).

Each launcher returns a :class:`RankGroup`: ``call(cmd, *args)`` runs one command on every
rank (:class:`~trainer.learner.distributed.worker.RankServer`) and returns the per-rank results,
or raises :class:`RankError` promptly when a rank raises, dies or exceeds
``learner.backend_settings.timeout_s`` (the group is then closed: no rank is left waiting in a collective). A
:class:`~trainer.errors.ConfigError` raised in a rank (a setting the rank learner refuses, e.g.
``model.dtype=bfloat16`` for ``megatron`` on CPU) is raised again as a ``ConfigError`` in the
driver (``copc train`` exits with status 2), the group closed the same way.

* ``spawn``: ``world_size`` child interpreters on this machine, one socket pair each (tensors
  travel through shared memory);
* ``ray``: one Ray actor per rank in a placement group, on the Ray cluster of the backend's own
  settings (``learner.backend_settings.ray_address``, empty: a local one with ``ray_num_cpus`` CPUs;
  :func:`trainer.ray_util.connect_ray`, as the Ray launcher and ``copc sweep``); rank 0's node
  address is the rendezvous;
* ``torchrun``: this process is rank 0 of a group started by ``torchrun``; commands are
  broadcast to the other ranks, which run :func:`~.worker.serve_torchrun_worker`.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
import socket
import subprocess
import sys
import time
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import Any, Protocol

import torch.distributed as dist

from ...errors import ConfigError
from ..backend_settings import DistributedSettings
from ..spec import LearnerSpec
from .worker import (
    CONFIG_ERROR,
    RankServer,
    RankSpec,
    broadcast_command,
    init_rank,
    run_and_report,
    torchrun_spec,
)

log = logging.getLogger(__name__)


class RankError(RuntimeError):
    """A learner rank raised, died or timed out; the message names the rank and the command."""


class RankGroup(Protocol):
    """The driver's handle on the ranks."""

    world_size: int

    def call(self, cmd: str, *args: Any) -> list[Any]:
        """Run ``cmd`` on every rank; per-rank results (rank 0 first; under torchrun only rank 0's).

        Raises:
            RankError: a rank raised, died or timed out (the group is closed).
            ConfigError: a rank refused a setting (the group is closed).
        """

    def close(self) -> None:
        """Stop the ranks (idempotent)."""


#: Variables set by ``torchrun`` (torch elastic) that must not reach spawned ranks: with
#: ``TORCHELASTIC_USE_AGENT_STORE=True`` inherited, ``init_process_group`` expects torchrun's
#: agent to host the rendezvous store, so no rank starts one and all of them wait until
#: ``learner.backend_settings.timeout_s``.
TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
                "ROLE_RANK", "ROLE_WORLD_SIZE", "ROLE_NAME", "MASTER_ADDR", "MASTER_PORT")


def spawn_env(base: dict[str, str], authkey: str) -> dict[str, str]:
    """The environment of a spawned rank: ``base`` without torchrun's variables
    (:data:`TORCHRUN_ENV`, ``TORCHELASTIC_*``), plus the driver's multiprocessing ``authkey``
    (``COPC_RANK_AUTHKEY``) and this repository on ``PYTHONPATH``."""
    env = {k: v for k, v in base.items() if k not in TORCHRUN_ENV and not k.startswith("TORCHELASTIC_")}
    env["COPC_RANK_AUTHKEY"] = authkey
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).resolve().parents[3]),
                                         base.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return env


def free_port(host: str = "127.0.0.1") -> int:
    """An unused TCP port on ``host`` (the OS picks it; free when returned)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


class SpawnGroup:
    """``world_size`` rank processes started on this machine (``learner.backend_settings.launch: spawn``).

    Each rank is a fresh interpreter (``python -m trainer.learner.distributed.rank_main``; nothing of
    the driver's ``__main__`` is re-run, so a script without a ``__main__`` guard works) joined to
    the driver by a socket pair. Messages are pickled with multiprocessing's pickler, so tensors
    travel through shared memory (the ranks share the driver's multiprocessing authkey).

    Args:
        spec: the :class:`~trainer.learner.spec.LearnerSpec` (sent pickled to every rank).
        model_dir: the actor's directory.

    Raises:
        RankError: a rank failed to start (its traceback in the message).
        ConfigError: a rank refused a setting while building its learner.
    """

    def __init__(self, spec: LearnerSpec, model_dir: str | Path) -> None:
        import torch.multiprocessing  # noqa: F401 - registers the shared-memory tensor pickling

        sec = spec.settings_as(DistributedSettings)
        self.world_size, self.timeout_s = sec.world_size, sec.timeout_s
        init = f"tcp://127.0.0.1:{free_port()}"
        env = spawn_env(dict(os.environ), multiprocessing.current_process().authkey.hex())
        self.procs: list[subprocess.Popen] = []
        self.conns: list[Connection] = []
        self._closed = False
        try:
            for rank in range(self.world_size):
                mine, theirs = socket.socketpair()
                self.procs.append(subprocess.Popen(
                    [sys.executable, "-m", "trainer.learner.distributed.rank_main", str(theirs.fileno())],
                    pass_fds=(theirs.fileno(),), env=env, stdin=subprocess.DEVNULL))
                theirs.close()
                self.conns.append(Connection(mine.detach()))
                self.conns[-1].send((RankSpec.from_settings(sec, rank, init), spec, str(model_dir)))
        except BaseException:
            self.close(graceful=False)
            raise
        self.ready = self._collect("start")

    @property
    def pids(self) -> list[int]:
        """Process ids of the ranks (rank order)."""
        return [int(p.pid) for p in self.procs]

    def call(self, cmd: str, *args: Any) -> list[Any]:
        """See :meth:`RankGroup.call`."""
        if self._closed:
            raise RankError(f"learner ranks are closed (after an earlier failure); cannot run {cmd!r}")
        for rank, conn in enumerate(self.conns):
            try:
                conn.send((cmd, args))
            except OSError as e:
                self._fail(f"learner rank {rank} (pid {self.procs[rank].pid}) is gone (exit code "
                           f"{self.procs[rank].poll()}) when sending {cmd!r}: {e}")
        return self._collect(cmd)

    def _collect(self, cmd: str) -> list[Any]:
        results: list[Any] = [None] * self.world_size
        pending = set(range(self.world_size))
        deadline = time.monotonic() + self.timeout_s
        while pending:
            left = deadline - time.monotonic()
            if left <= 0:
                self._fail(f"learner ranks {sorted(pending)} did not answer {cmd!r} within "
                           f"learner.backend_settings.timeout_s={self.timeout_s}")
            ready = wait([self.conns[r] for r in pending], timeout=min(1.0, left))
            for r in sorted(pending):
                if self.conns[r] in ready:
                    try:
                        status, value = self.conns[r].recv()
                    except (EOFError, OSError):
                        self._died(r, cmd)
                    if status == CONFIG_ERROR:
                        self.close(graceful=False)
                        raise ConfigError(value)
                    if status != "ok":
                        self._fail(f"learner rank {r} raised during {cmd!r}:\n{value}")
                    results[r] = value
                    pending.discard(r)
                elif self.procs[r].poll() is not None:  # ended without a reply (killed, crashed)
                    self._died(r, cmd)
        return results

    def _died(self, rank: int, cmd: str) -> None:
        proc = self.procs[rank]
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=5)
        self._fail(f"learner rank {rank} (pid {proc.pid}) died during {cmd!r} (exit code {proc.poll()})")

    def _fail(self, msg: str) -> None:
        self.close(graceful=False)
        raise RankError(msg)

    def close(self, graceful: bool = True) -> None:
        """Stop the ranks: ``shutdown`` then wait (graceful), else terminate/kill. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if graceful:
            for conn in self.conns:
                with contextlib.suppress(OSError):
                    conn.send(("shutdown", ()))
            for proc in self.procs:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(timeout=30)
        for proc in self.procs:
            if proc.poll() is None:
                proc.terminate()
        for proc in self.procs:
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=5)
        for conn in self.conns:
            conn.close()


class RankActor:
    """One rank as a Ray actor (``learner.backend_settings.launch: ray``); see :class:`RayGroup`."""

    def __init__(self) -> None:
        self.server: RankServer | None = None

    def address(self) -> tuple[str, int]:
        """This node's IP and a free port on it (rank 0's are the rendezvous)."""
        import ray

        ip = ray.util.get_node_ip_address()
        return ip, free_port("0.0.0.0")

    def setup(self, rank_spec: RankSpec, spec: LearnerSpec, model_dir: str) -> int:
        """Join the group and build the rank learner; returns its policy version."""
        ctx = init_rank(rank_spec, spec.torch_threads, spec.malloc_mmap_threshold)
        self.server = RankServer.build(spec, model_dir, ctx)
        return self.server.learner.policy_version

    def call(self, cmd: str, args: tuple) -> Any:
        """:meth:`RankServer.handle`."""
        assert self.server is not None, "setup() first"
        return self.server.handle(cmd, args)


class RayGroup:
    """One Ray actor per rank in a placement group (``learner.backend_settings.launch: ray``).

    Ray is joined or started here unless already initialised in this process
    (:func:`~trainer.ray_util.connect_ray` with ``learner.backend_settings.ray_address`` /
    ``ray_num_cpus``). Each rank reserves 1 CPU (and 1 GPU with NCCL).

    Raises:
        RankError: a rank failed to start or the placement group could not be placed in time.
    """

    def __init__(self, spec: LearnerSpec, model_dir: str | Path) -> None:
        import ray
        from ray.util.placement_group import placement_group, remove_placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        from ...ray_util import connect_ray
        from .worker import resolve_dist_backend

        sec = spec.settings_as(DistributedSettings)
        self.world_size, self.timeout_s = sec.world_size, sec.timeout_s
        self._owns_ray = connect_ray(sec.ray_address, sec.ray_num_cpus)
        gpu = resolve_dist_backend(sec.dist_backend) == "nccl"
        bundle = {"CPU": 1, "GPU": 1} if gpu else {"CPU": 1}
        self._pg = placement_group([bundle] * self.world_size, strategy="PACK")
        self._remove_pg = remove_placement_group
        self._closed = False
        if not self._pg.wait(timeout_seconds=min(120.0, self.timeout_s)):
            self._fail(f"learner.backend_settings.world_size={self.world_size}: Ray could not place "
                       f"{self.world_size} rank bundles {bundle} (too few CPUs/GPUs in the cluster?)")
        actor_cls = ray.remote(RankActor)
        self.actors = [actor_cls.options(
            num_cpus=1, num_gpus=1 if gpu else 0, name=None,
            scheduling_strategy=PlacementGroupSchedulingStrategy(self._pg, placement_group_bundle_index=r),
            runtime_env={"env_vars": {"TOKENIZERS_PARALLELISM": "false"}}).remote()
            for r in range(self.world_size)]
        ip, port = self._get([self.actors[0].address.remote()], "address")[0]
        init = f"tcp://{ip}:{port}"
        # local ranks on one node: Ray's PACK places bundles together; LOCAL_RANK = rank
        self.ready = self._get([a.setup.remote(RankSpec.from_settings(sec, r, init), spec, str(model_dir))
                                for r, a in enumerate(self.actors)], "start")

    def _get(self, refs: list[Any], cmd: str) -> list[Any]:
        import ray

        deadline = time.monotonic() + self.timeout_s
        pending = list(refs)
        while pending:
            done, pending = ray.wait(pending, num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
            if not done:
                self._fail(f"learner ranks did not answer {cmd!r} within learner.backend_settings.timeout_s="
                           f"{self.timeout_s}")
            try:
                ray.get(done[0])
            except Exception as e:  # RayTaskError (a rank raised) or RayActorError (a rank died)
                cause = getattr(e, "cause", None)
                if isinstance(cause, ConfigError):
                    self.close()
                    raise ConfigError(str(cause)) from None
                self._fail(f"learner rank {refs.index(done[0])} failed during {cmd!r}: {e}")
        return ray.get(refs)

    def call(self, cmd: str, *args: Any) -> list[Any]:
        """See :meth:`RankGroup.call`."""
        if self._closed:
            raise RankError(f"learner ranks are closed (after an earlier failure); cannot run {cmd!r}")
        return self._get([a.call.remote(cmd, args) for a in self.actors], cmd)

    def _fail(self, msg: str) -> None:
        self.close()
        raise RankError(msg)

    def close(self) -> None:
        """Kill the rank actors and remove the placement group (Ray itself is left running if
        it was running before). Idempotent."""
        import ray

        if self._closed:
            return
        self._closed = True
        for a in getattr(self, "actors", []):
            ray.kill(a, no_restart=True)
        try:
            self._remove_pg(self._pg)
        except Exception as e:  # the cluster may already be gone
            log.warning("removing the learner placement group failed: %s", e)
        if self._owns_ray:
            ray.shutdown()


class TorchrunGroup:
    """This process is rank 0 of a ``torchrun`` group (``learner.backend_settings.launch: torchrun``);
    the other ranks run :func:`~.worker.serve_torchrun_worker` (started by ``copc train`` itself when
    ``RANK > 0``). Commands are broadcast from here; every rank reports its error status after
    each command, so a rank's exception raises here (a hung collective ends at ``timeout_s``).

    Raises:
        ConfigError: not started by torchrun, or another world size (see
            :func:`~.worker.torchrun_spec`); a rank refused a setting.
        RankError: the build failed on some rank.
    """

    def __init__(self, spec: LearnerSpec, model_dir: str | Path) -> None:
        rank_spec = torchrun_spec(spec.settings_as(DistributedSettings))
        if rank_spec.rank != 0:
            raise ValueError(f"learner.backend_settings.launch='torchrun': the driver must be RANK 0, this "
                             f"is RANK {rank_spec.rank}")
        self.world_size = rank_spec.world_size
        self.ctx = init_rank(rank_spec, spec.torch_threads, spec.malloc_mmap_threshold)
        self._closed = False
        self.server: RankServer | None = None
        self.server = self._run("build", (spec, str(model_dir)), build=lambda: RankServer.build(
            spec, model_dir, self.ctx))
        self.ready = [self.server.learner.policy_version]

    def _run(self, cmd: str, args: tuple, build: Any = None) -> Any:
        if self._closed:
            raise RankError(f"learner ranks are closed (after an earlier failure); cannot run {cmd!r}")
        broadcast_command((cmd, args), self.ctx)
        result, errors = run_and_report(self.server, cmd, args, self.ctx, build=build)
        bad = [(r, e) for r, e in enumerate(errors) if e]
        if bad:
            self._closed = True
            dist.destroy_process_group()
            rank, (status, text) = bad[0]
            if status == CONFIG_ERROR:
                raise ConfigError(text)
            raise RankError(f"learner rank {rank} raised during {cmd!r}:\n{text}")
        return result

    def call(self, cmd: str, *args: Any) -> list[Any]:
        """See :meth:`RankGroup.call` (only rank 0's result)."""
        return [self._run(cmd, args)]

    def close(self) -> None:
        """Tell the other ranks to stop and leave the group. Idempotent."""
        if self._closed:
            return
        self._closed = True
        broadcast_command(("shutdown", ()), self.ctx)
        dist.destroy_process_group()


#: How the rank processes of a distributed learner start (``learner.backend_settings.launch``) →
#: the :class:`RankGroup` that starts them. Not to be confused with the run launchers of
#: :data:`trainer.orchestration.launchers.LAUNCHERS` (where rollouts and the learner run).
RANK_GROUPS = {"spawn": SpawnGroup, "ray": RayGroup, "torchrun": TorchrunGroup}


def start_ranks(spec: LearnerSpec, model_dir: str | Path) -> RankGroup:
    """Start the ranks of ``learner.backend_settings.launch`` (``spec.settings_as(DistributedSettings)``)
    and build their learners from ``spec`` (blocks until all are ready).

    Raises:
        RankError: a rank failed to start. ConfigError: a rank refused a setting; torchrun
            environment missing or of another size.
    """
    return RANK_GROUPS[spec.settings_as(DistributedSettings).launch](spec, model_dir)
