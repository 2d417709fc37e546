"""The Ray launcher's parts: rollout workers and the learner as Ray actors, same loop as local.

The driver runs the very same :class:`~trainer.orchestration.loop.AsyncTrainingLoop` as the
local launcher (admission control, per-token staleness check, drop + re-queue, checkpoints);
only the objects it is given differ:

* :class:`RayRollouts` (a :class:`~trainer.orchestration.rollouts.Rollouts`) — prompt groups
  are sent round-robin to :class:`RolloutWorker` actors; each worker builds its engine through
  the engine registry (``rollout.engine``), its environments from the task (or a given
  factory), and plays a group with the shared runner :func:`trainer.rollout.groups.run_group`.
  A weight sync from the :class:`RayLearner` produces its weights once in Ray's object store and
  passes the reference to every worker (each pulls them from the store; nothing goes through the
  driver); a kept fixed-lag snapshot is put there by the driver;
* :class:`RayLearner` (a :class:`~trainer.learner.base.Learner`) — a proxy whose methods call one
  :class:`LearnerActor`, which hosts any learner backend (``learner.backend``, built by
  :func:`~trainer.learner.base.make_learner` from the :class:`~trainer.learner.spec.LearnerSpec` the
  driver builds and Ray pickles to it). Checkpoints read its state from the actor.

:func:`launch_ray` (registered as launcher ``ray`` in :mod:`trainer.orchestration.launchers`)
starts them for ``copc train`` and, after a successful run, copies the learner actor's final
state into the driver's learner and its weights into the driver's engine (evaluation).

Beyond one machine: start a Ray cluster (``ray start --head`` on one node, ``ray start
--address=HEAD:6379`` on the others, or any Ray cluster launcher / KubeRay), then set
``launcher.kind=ray launcher.settings.address=HEAD:6379 launcher.settings.num_rollout_workers=N``.
Workers load the architecture and tokenizer from the model directory, so it must be
visible at the same path on every node (shared filesystem); the weights themselves
travel through the object store. A task shares its services with the workers itself
(:meth:`~trainer.tasks.base.Task.worker_spec`); a service it starts listens on 127.0.0.1 of the
driver, so across nodes give it (in the task's settings) an address every node can reach.
GPU placement is chosen with Ray's actor options (``RayRolloutSpec.options`` /
:meth:`RayLearner.start`'s ``options``, e.g. ``{"num_gpus": 1}``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
from collections.abc import AsyncIterator, Callable, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from ..engines.base import GenerationResult, SamplingParams
from ..models.lora import adapter_of
from ..rollout.agent_loop import AgentLoopConfig
from ..rollout.groups import EnvPool, run_group
from ..rollout.trajectory import Trajectory
from .lag import WeightSnapshot
from .ray_learner import RayLearner
from .rollouts import WeightSource, push_weights

if TYPE_CHECKING:
    from ..config.task_spec import TaskSpec
    from ..engines.registry import EngineSpec

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class WorkerSpec:
    """What each :class:`RolloutWorker` builds its engine and environments from (picklable; built
    by :func:`worker_spec` on the driver, never the experiment config).

    Attributes:
        engine_kind: the registered engine (``rollout.engine``).
        engine: its :class:`~trainer.engines.registry.EngineSpec` without the per-process fields
            (the worker fills in its tokenizer, version, weights and adapter).
        task: the :class:`~trainer.config.task_spec.TaskSpec` of the worker's own copy of the
            driver's task (:meth:`~trainer.tasks.base.Task.worker_spec`: paths absolute, the
            started services reused), or None when the workers are given an environment factory.
        plugins: the user's plug-in files / modules, absolute, imported first in the worker.
    """

    engine_kind: str
    engine: EngineSpec
    task: TaskSpec | None = None
    plugins: tuple[str, ...] = ()


class RolloutWorker:
    """Rollout worker (a Ray actor via :func:`ray.remote`): an engine from the registry + envs.

    Args:
        worker: the :class:`WorkerSpec` (engine, task, plug-ins).
        model_dir: ``save_pretrained`` directory giving the architecture and tokenizer.
        weights: initial policy weights (Hugging Face names; the driver's current ones); empty with
            ``adapter``.
        version: policy version of ``weights``.
        env_factory: picklable zero-argument environment factory, or ``None`` to build the task
            of ``worker.task`` with :func:`trainer.tasks.build_task` (its services are closed by
            :meth:`close`).
        concurrency: episodes in flight at once on this worker (environments kept).
        adapter: a LoRA policy's adapter (the engine serves ``model_dir``'s weights with it, and
            :meth:`update_adapter` moves adapters only), or None.
        index: the worker's number: its engine writes under ``<work_dir>/rollout_worker_<index>``
            (a server engine's log and synced weights; never a file of another worker or the driver).
    """

    def __init__(self, worker: WorkerSpec, model_dir: str, weights: Mapping[str, torch.Tensor],
                 version: int, env_factory: Callable[[], Any] | None = None, *, concurrency: int = 8,
                 adapter: Any = None, index: int = 0) -> None:
        from ..engines import make_engine
        from ..models.loading import load_tokenizer
        from ..plugins import import_plugins

        import_plugins(list(worker.plugins))  # the user's registrations, in this process too
        self.tok = load_tokenizer(model_dir)
        work = worker.engine.work_dir
        spec = dataclasses.replace(worker.engine, model_dir=Path(model_dir), tokenizer=self.tok,
                                   version=version, weights=weights.items() if weights else None,
                                   adapter=adapter,
                                   work_dir=None if work is None else work / f"rollout_worker_{index}")
        self.handle = make_engine(worker.engine_kind, spec)
        self.task = None
        episode = None  # a given factory's environments: the tool-environment loop
        if env_factory is None:
            from ..tasks import build_task

            if worker.task is None:
                raise ValueError("RolloutWorker: WorkerSpec.task is None and no env_factory was given")
            self.task = build_task(worker.task)
            env_factory, episode = self.task.make_env, self.task.episode()
        self.pool = EnvPool(env_factory, concurrency, episode)

    @property
    def engine(self) -> Any:
        """The worker's inference engine."""
        return self.handle.engine

    async def run_group(self, uid: int, sample: Mapping[str, Any], n: int, sampling: SamplingParams,
                        agent_cfg: AgentLoopConfig) -> list[Trajectory]:
        """Play the ``n`` episodes of prompt draw ``uid`` (:func:`trainer.rollout.groups.run_group`)."""
        return await run_group(self.engine, self.pool, self.tok, sample, n, sampling, agent_cfg, uid=uid)

    async def probe(self, prompt_ids: list[int], params: SamplingParams) -> GenerationResult:
        """One request straight to the engine (the weight-sync attestation's probe,
        :mod:`.attestation`)."""
        return await self.engine.generate(prompt_ids, params)

    async def update_weights(self, weights: Mapping[str, torch.Tensor], version: int) -> int:
        """Make the engine generate with ``weights`` as policy ``version``; returns the engine's version.

        Raises:
            EngineError: if the weights do not match the model.
        """
        await self.handle.sync(weights.items(), version)
        return self.engine.version

    async def update_adapter(self, adapter: Any, version: int) -> int:
        """Make the engine generate with LoRA ``adapter`` as policy ``version`` (the adapter's tensors
        only: :func:`~trainer.orchestration.rollouts.push_weights`); returns the engine's version."""
        await push_weights(self.handle, WeightSnapshot(adapter), version)
        return self.engine.version

    async def version(self) -> int:
        """The engine's current policy version."""
        return self.engine.version

    async def engine_state_dict(self) -> dict[str, torch.Tensor]:
        """The embedded engine's weights (to check that a sync arrived)."""
        return {k: v.detach().clone() for k, v in self.engine.model.state_dict().items()}

    async def close(self) -> None:
        """Close the environments, stop the engine and release the task's services (sandbox, ...)."""
        await self.pool.close()
        await self.handle.close()
        if self.task is not None:
            await asyncio.to_thread(self.task.close)


@dataclass
class RayRolloutSpec:
    """How :class:`RayRollouts` starts its workers.

    Attributes:
        worker: the workers' :class:`WorkerSpec` (engine, task, plug-ins; :func:`worker_spec`).
        model_dir: ``save_pretrained`` directory of the architecture + tokenizer.
        sampling: rollout sampling parameters. agent_cfg: episode budgets.
        env_factory: how each worker builds environments (None: the task of ``worker.task``).
        num_workers: rollout worker actors (``launcher.settings.num_rollout_workers``).
        concurrency: episodes in flight at once per worker.
        options: Ray actor options of the workers (``num_cpus``, ``num_gpus``, ...).

    Raises:
        ValueError: ``num_workers < 1``.
    """

    worker: WorkerSpec
    model_dir: str | Path
    sampling: SamplingParams
    agent_cfg: AgentLoopConfig
    env_factory: Callable[[], Any] | None = None
    num_workers: int = 1
    concurrency: int = 8
    options: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        """Validate the worker count."""
        if self.num_workers < 1:
            raise ValueError(f"launcher.settings.num_rollout_workers={self.num_workers!r}: must be >= 1")


class RayRollouts:
    """:class:`~trainer.orchestration.rollouts.Rollouts` played by :class:`RolloutWorker` actors.

    Args:
        spec: the workers' :class:`RayRolloutSpec`.
        weights: the initial policy weights (e.g. the driver's learner).
        version: their policy version.

    Ray must be initialised.
    """

    def __init__(self, spec: RayRolloutSpec, weights: WeightSource, version: int) -> None:
        import ray

        self.spec = spec
        adapter = adapter_of(weights)  # a LoRA policy: workers get the adapter, never full weights
        ref = ray.put({} if adapter is not None else dict(weights.export_policy_weights()))
        worker_cls = ray.remote(RolloutWorker).options(**spec.options)
        self.workers = [worker_cls.remote(spec.worker, str(spec.model_dir), ref, version, spec.env_factory,
                                          concurrency=spec.concurrency, adapter=adapter, index=i)
                        for i in range(spec.num_workers)]
        self._rr = itertools.count()

    async def run_group(self, uid: int, sample: Mapping[str, Any], n: int) -> list[Trajectory]:
        """Play prompt draw ``uid`` on the next worker (round-robin)."""
        worker = self.workers[next(self._rr) % len(self.workers)]
        return await worker.run_group.remote(uid, dict(sample), n, self.spec.sampling, self.spec.agent_cfg)

    async def probe(self, prompt_ids: list[int], params: SamplingParams) -> list[GenerationResult]:
        """The weight-sync attestation's probe (:mod:`.attestation`) on EVERY worker: one
        :class:`~trainer.engines.base.GenerationResult` per worker, in worker order (each worker's
        engine is checked against the learner's reference, so one that missed a sync is caught)."""
        return list(await asyncio.gather(*(w.probe.remote(list(prompt_ids), params) for w in self.workers)))

    async def sync(self, source: WeightSource, version: int) -> None:
        """Push ``version`` to every worker: a LoRA source's adapter only; a :class:`RayLearner`'s
        full weights go from its actor to the workers through the object store; any other source's
        are put there by the driver."""
        import ray

        adapter = adapter_of(source)
        if adapter is not None:
            ref = ray.put(adapter.copy("cpu"))
            await asyncio.gather(*(w.update_adapter.remote(ref, version) for w in self.workers))
            return
        if isinstance(source, RayLearner):
            ref = source.policy_weights_ref()  # produced once, pulled by each worker
        else:
            ref = ray.put(dict(source.export_policy_weights()))
        await asyncio.gather(*(w.update_weights.remote(ref, version) for w in self.workers))

    async def close(self) -> None:
        """Close the workers (engines, task services) and kill them (idempotent)."""
        import ray

        workers, self.workers = self.workers, []
        if workers:
            await asyncio.gather(*(w.close.remote() for w in workers), return_exceptions=True)
        for w in workers:
            ray.kill(w)


def worker_spec(spec: Any) -> WorkerSpec:
    """The :class:`WorkerSpec` of a :class:`~trainer.orchestration.launchers.LaunchSpec`: its engine
    (``engine_kind``, ``engine_spec``), what the driver's started task hands the workers
    (:meth:`~trainer.tasks.base.Task.worker_spec`: its services' URLs, absolute task paths) and the
    plug-ins (absolute already: workers may run in another working directory)."""
    return WorkerSpec(engine_kind=spec.engine_kind, engine=spec.engine_spec, task=spec.task.worker_spec(),
                      plugins=tuple(spec.plugins))


@asynccontextmanager
async def launch_ray(spec: Any) -> AsyncIterator[tuple[RayLearner, RayRollouts]]:
    """The ``ray`` launcher: a :class:`RayLearner` and :class:`RayRollouts` for ``copc train``.

    Connects to the settings' ``address`` (or starts a local cluster with ``num_cpus`` CPUs;
    :func:`~trainer.ray_util.connect_ray`), starts the learner actor from the driver's learner state
    and ``num_rollout_workers`` workers that build their environments from the task's spec
    (reusing the driver's task's services: :func:`worker_spec`) and their engines
    through the registry. After a successful run the driver's learner gets the actor's final state
    and the driver's engine its weights; the actors are stopped in any case (and Ray, if this call
    started it).

    Args:
        spec: the :class:`~trainer.orchestration.launchers.LaunchSpec`; ``spec.settings`` its
            :class:`~trainer.orchestration.launchers.RayLauncherSettings`.
    """
    import ray

    from ..ray_util import connect_ray

    settings = spec.settings
    started = connect_ray(settings.address, settings.num_cpus)
    learner: RayLearner | None = None
    rollouts: RayRollouts | None = None
    try:
        learner = RayLearner.start(spec.learner_spec, spec.model_dir, spec.learner.state_dict())
        rollouts = RayRollouts(RayRolloutSpec(worker_spec(spec), spec.model_dir, spec.sampling,
                                              spec.agent_cfg, num_workers=settings.num_rollout_workers,
                                              concurrency=spec.concurrency),
                               spec.learner, spec.learner.policy_version)
        yield learner, rollouts
        spec.learner.load_state_dict(await asyncio.to_thread(learner.state_dict))
        # the driver's engine (evaluation) gets the final weights
        await push_weights(spec.engine, spec.learner, spec.learner.policy_version)
    finally:
        if rollouts is not None:
            await rollouts.close()
        if learner is not None:
            learner.close()
        if started:
            ray.shutdown()
