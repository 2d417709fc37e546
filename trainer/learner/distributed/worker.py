"""Inside a rank process: ``torch.distributed`` set-up, the rank learner, and its command loop.

The driver (:class:`~trainer.learner.distributed.runtime.DistributedLearner`) sends the same
command to every rank; :class:`RankServer` runs it on the rank's
:class:`~trainer.learner.distributed.base.RankLearner`. Three transports carry the commands
(:mod:`.launch`): a pipe per spawned process (:func:`spawn_main`), Ray actor calls, and, under
``torchrun``, a broadcast from rank 0 (:func:`serve_torchrun_worker`).
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import os
import sys
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ...errors import ConfigError
from ...parent_watch import exit_with_parent
from ..allocator import release_free_heap, set_malloc_mmap_threshold
from ..backend_settings import DistributedSettings
from ..spec import LearnerSpec
from .base import GradientProbe, MemoryProbe, RankContext, RankLearner
from .collectives import all_gather_objects, broadcast_object

log = logging.getLogger(__name__)

#: Reply statuses of a failed rank command: a bad setting only checkable inside a rank (the
#: driver raises :class:`~trainer.errors.ConfigError` with the message), or any other exception
#: (the driver raises ``RankError`` with the traceback).
CONFIG_ERROR, ERROR = "config_error", "error"

#: Commands a rank serves (each maps to one collective call on the rank learner).
COMMANDS = ("step", "export", "save", "load", "gradients", "state_bytes", "version")


@dataclass(frozen=True)
class RankSpec:
    """How one rank joins the process group.

    Attributes:
        rank / world_size: global rank and size. local_rank: rank on its machine.
        local_world_size: ranks on its machine (splits the CPU threads).
        init_method: ``tcp://host:port`` (spawn, ray) or ``env://`` (torchrun).
        tp_size / pp_size: model-parallel sizes (the layout of :class:`RankContext`).
        dist_backend: ``auto`` | ``gloo`` | ``nccl``. timeout_s: collective timeout.
    """

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    init_method: str
    tp_size: int = 1
    pp_size: int = 1
    dist_backend: str = "auto"
    timeout_s: float = 1800.0

    @classmethod
    def from_settings(cls, settings: DistributedSettings, rank: int, init_method: str,
                      local_rank: int | None = None, local_world_size: int | None = None) -> RankSpec:
        """The spec of ``rank`` from the backend's
        :class:`~trainer.learner.backend_settings.DistributedSettings` (``local_rank`` defaults to
        ``rank``, ``local_world_size`` to ``world_size``: every rank on this machine)."""
        return cls(rank=rank, world_size=settings.world_size,
                   local_rank=rank if local_rank is None else local_rank,
                   local_world_size=settings.world_size if local_world_size is None else local_world_size,
                   init_method=init_method, tp_size=settings.tensor_parallel_size,
                   pp_size=settings.pipeline_parallel_size, dist_backend=settings.dist_backend,
                   timeout_s=settings.timeout_s)


def resolve_dist_backend(name: str) -> str:
    """``auto`` → ``nccl`` when CUDA is available, else ``gloo``; other names unchanged.

    Raises:
        ConfigError: ``nccl`` without CUDA (naming ``learner.backend_settings.dist_backend``).
    """
    if name == "auto":
        return "nccl" if torch.cuda.is_available() else "gloo"
    if name == "nccl" and not torch.cuda.is_available():
        raise ConfigError("learner.backend_settings.dist_backend='nccl' needs CUDA; this machine has none "
                          "(use 'gloo' or "
                         "'auto')")
    return name


def init_rank(spec: RankSpec, threads: int = 0, mmap_threshold: int = 0) -> RankContext:
    """Join the process group (``init_process_group``) and describe this rank.

    Args:
        spec: the rank's :class:`RankSpec`.
        threads: torch intra-op threads (0: this machine's cores split between its ranks).
        mmap_threshold: this process's malloc mmap threshold in bytes
            (``learner.malloc_mmap_threshold``; 0: glibc's default; :mod:`..allocator`).

    Returns:
        The :class:`RankContext` (a gloo ``cpu_group`` is created when the default group is NCCL).

    Raises:
        ValueError: bad sizes. ConfigError: ``nccl`` without CUDA. RuntimeError / DistNetworkError from
            ``init_process_group`` (e.g. the rendezvous timed out).
    """
    backend = resolve_dist_backend(spec.dist_backend)
    layout = RankContext.layout(spec.rank, spec.world_size, spec.tp_size, spec.pp_size)
    torch.set_num_threads(threads or max(1, (os.cpu_count() or 1) // max(1, spec.local_world_size)))
    set_malloc_mmap_threshold(mmap_threshold)
    device = torch.device("cpu")
    if backend == "nccl":
        index = spec.local_rank if torch.cuda.device_count() > spec.local_rank else 0
        torch.cuda.set_device(index)
        device = torch.device("cuda", index)
    timeout = datetime.timedelta(seconds=spec.timeout_s)
    dist.init_process_group(backend=backend, init_method=spec.init_method, rank=spec.rank,
                            world_size=spec.world_size, timeout=timeout)
    cpu_group = dist.new_group(backend="gloo", timeout=timeout) if backend != "gloo" else dist.group.WORLD
    return RankContext(rank=spec.rank, world_size=spec.world_size, local_rank=spec.local_rank, device=device,
                       dist_backend=backend, cpu_group=cpu_group, dp_group=None, timeout=timeout,
                       tp_size=spec.tp_size, pp_size=spec.pp_size, **layout)


def build_rank_learner(spec: LearnerSpec, model_dir: str | Path, ctx: RankContext) -> RankLearner:
    """The rank learner of ``spec.backend`` (``spec.plugins`` imported first, as in the driver).

    Raises:
        KeyError: no rank learner registered under that name. Whatever the factory raises.
    """
    from transformers.utils import logging as hf_logging

    from ...plugins import import_plugins
    from .base import RANK_LEARNERS

    hf_logging.disable_progress_bar()  # N ranks × "Loading weights" bars say nothing the driver does not
    import_plugins(spec.plugins)
    return RANK_LEARNERS.get(spec.backend)(spec, Path(model_dir), ctx)


class RankServer:
    """Runs driver commands on one rank's learner.

    Args:
        learner: the :class:`RankLearner`. ctx: its :class:`RankContext`.
        malloc_trim: after every ``step``, return the rank's free C heap to the OS
            (``spec.malloc_trim``; :func:`~..allocator.release_free_heap`).
    """

    def __init__(self, learner: RankLearner, ctx: RankContext, malloc_trim: bool = False) -> None:
        self.learner, self.ctx, self.malloc_trim = learner, ctx, malloc_trim

    @classmethod
    def build(cls, spec: LearnerSpec, model_dir: str, ctx: RankContext) -> RankServer:
        """The server of a rank learner built from ``spec`` (:func:`build_rank_learner`)."""
        return cls(build_rank_learner(spec, model_dir, ctx), ctx, spec.malloc_trim)

    def handle(self, cmd: str, args: tuple) -> Any:
        """Run one command; returns its picklable result (rank 0's is the one the driver reads).

        ``step(batch[, with_inputs])`` → ``{"metrics", "policy_version"}``, plus rank 0's
        ``"step_inputs"`` (its :class:`~trainer.learner.algorithm.StepInputs` on the CPU: the
        step's per-token log-probs and advantages, for the run's samples) when ``with_inputs``;
        ``export()`` → list of ``(HF name, tensor)`` (rank 0; ``[]`` elsewhere); ``save(dir)`` /
        ``load(dir)`` / ``version()`` → ``policy_version``; ``gradients()`` →
        :meth:`GradientProbe.named_gradients`; ``state_bytes()`` → :meth:`MemoryProbe.state_bytes`
        (every rank's own).

        Raises:
            ValueError: unknown command. TypeError: ``gradients`` / ``state_bytes`` on a learner
                without them.
        """
        lrn = self.learner
        if cmd == "step":  # args: (batch,) or (batch, with_inputs)
            out = {"metrics": lrn.step(args[0]), "policy_version": lrn.policy_version}
            if self.malloc_trim:
                release_free_heap()
            x = getattr(lrn, "last_step_inputs", None)
            if len(args) > 1 and args[1] and self.ctx.is_rank0 and x is not None:
                out["step_inputs"] = x.to(torch.device("cpu"))
            return out
        if cmd == "export":
            pairs = list(lrn.export_policy_weights())  # every rank iterates: the gathers are collective
            return pairs if self.ctx.is_rank0 else []
        if cmd in ("save", "load"):
            getattr(lrn, cmd)(Path(args[0]))
            return lrn.policy_version
        if cmd == "version":
            return lrn.policy_version
        if cmd == "gradients":
            if not isinstance(lrn, GradientProbe):
                raise TypeError(f"{type(lrn).__name__} has no named_gradients()")
            grads = lrn.named_gradients()
            return grads if self.ctx.is_rank0 else {}
        if cmd == "state_bytes":
            if not isinstance(lrn, MemoryProbe):
                raise TypeError(f"{type(lrn).__name__} has no state_bytes()")
            return lrn.state_bytes()
        raise ValueError(f"unknown rank command {cmd!r}; known: {COMMANDS}")


def failure_reply(exc: BaseException) -> tuple[str, str]:
    """A rank's reply for a command that raised ``exc`` (call inside the ``except`` block):
    ``(CONFIG_ERROR, message)`` for a :class:`~trainer.errors.ConfigError` (e.g. a setting the
    rank learner refuses at build), else ``(ERROR, traceback)``."""
    if isinstance(exc, ConfigError):
        return CONFIG_ERROR, str(exc)
    return ERROR, traceback.format_exc()


def _exit_with_parent(poll_s: float = 1.0) -> None:
    """Exit this process when its parent dies (a SIGKILLed driver leaves no orphan ranks, even
    while a rank waits inside a collective)."""
    exit_with_parent(os.getppid(), lambda: os._exit(3), poll_s)


def spawn_main(conn: Any) -> None:
    """Main of a spawned rank (:class:`~.launch.SpawnGroup`): read ``(RankSpec, LearnerSpec, model_dir)``
    from the driver's connection, join, build, then serve ``(cmd, args)`` messages until
    ``shutdown`` or EOF; replies ``("ok", result)``, or :func:`failure_reply` (``("error",
    traceback)`` / ``("config_error", message)``). The first reply (after the build) is
    ``("ok", policy_version)``. Exits the process when done."""
    _exit_with_parent()
    server = None
    try:
        rank_spec, spec, model_dir = conn.recv()  # unpickling the LearnerSpec imports its plug-ins
        ctx = init_rank(rank_spec, spec.torch_threads, spec.malloc_mmap_threshold)
        server = RankServer.build(spec, model_dir, ctx)
        conn.send(("ok", server.learner.policy_version))
        while True:
            try:
                cmd, args = conn.recv()
            except EOFError:
                return
            if cmd == "shutdown":
                conn.send(("ok", None))
                return
            try:
                conn.send(("ok", server.handle(cmd, args)))
            except BaseException as e:
                conn.send(failure_reply(e))
    except BaseException as e:
        with contextlib.suppress(OSError):
            conn.send(failure_reply(e))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)  # nothing left to flush (checkpoints are fsync-ed); skips seconds of interpreter teardown


def torchrun_spec(settings: DistributedSettings) -> RankSpec:
    """This process's :class:`RankSpec` from torchrun's environment (``RANK``, ``WORLD_SIZE``,
    ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``/``MASTER_PORT``) and the backend's settings.

    Raises:
        ConfigError: not started by torchrun, or ``WORLD_SIZE`` differs from ``settings.world_size``
            (naming ``learner.backend_settings.launch`` / ``.world_size``; ``copc train`` exits 2).
    """
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        raise ConfigError("learner.backend_settings.launch='torchrun': RANK/WORLD_SIZE are not set; start "
                          "the run with `torchrun --nproc-per-node N -m trainer.cli train ...`")
    world = int(os.environ["WORLD_SIZE"])
    if world != settings.world_size:
        raise ConfigError(f"learner.backend_settings.world_size={settings.world_size} but torchrun started "
                          f"WORLD_SIZE={world}")
    rank = int(os.environ["RANK"])
    return RankSpec.from_settings(settings, rank, "env://",
                                  local_rank=int(os.environ.get("LOCAL_RANK", rank)),
                                  local_world_size=int(os.environ.get("LOCAL_WORLD_SIZE", world)))


def broadcast_command(msg: Any, ctx: RankContext) -> Any:
    """Rank 0's ``msg`` on every rank, over the gloo ``cpu_group``
    (:func:`~.collectives.broadcast_object`: a rank may exit right after the ``shutdown`` command).

    Raises:
        As :func:`~.collectives.broadcast_object`.
    """
    return broadcast_object(msg, ctx.cpu_group, src=0)


def run_and_report(server: RankServer | None, cmd: str, args: tuple, ctx: RankContext,
                   build: Any = None) -> tuple[Any, list[tuple[str, str] | None]]:
    """Run a command on this rank, then all-gather every rank's error (None = ok, else the
    :func:`failure_reply` pair ``(status, text)``).

    ``build`` (a zero-argument callable returning a :class:`RankServer`) replaces ``server`` for
    the ``build`` command. Returns ``(result or new server, errors by rank)``. Collective.
    """
    result, err = None, None
    try:
        result = build() if cmd == "build" else server.handle(cmd, args)  # type: ignore[union-attr]
    except BaseException as e:
        err = failure_reply(e)
    errors: list[tuple[str, str] | None] = all_gather_objects(err, ctx.cpu_group)
    return result, errors


def serve_torchrun_worker(spec: LearnerSpec) -> None:
    """Main of ranks > 0 under ``torchrun``: join, then run rank 0's broadcast commands (the first
    is ``build`` with the model directory) until ``shutdown``. Returns when rank 0 shuts down.

    Raises:
        ConfigError: as :func:`torchrun_spec`.
    """
    ctx = init_rank(torchrun_spec(spec.settings_as(DistributedSettings)), spec.torch_threads,
                    spec.malloc_mmap_threshold)
    server: RankServer | None = None
    try:
        while True:
            cmd, args = broadcast_command(None, ctx)
            if cmd == "shutdown":
                return
            result, errors = run_and_report(
                server, cmd, args, ctx,
                build=lambda a=args: RankServer.build(a[0], a[1], ctx))
            if cmd == "build" and errors[ctx.rank] is None:
                server = result
            if any(errors):
                log.error("torchrun rank %d: command %r failed on some rank; stopping", ctx.rank, cmd)
                return
    finally:
        dist.destroy_process_group()

