"""The Ray launcher: rollout workers and the learner as Ray actors, same loop as the local launcher.

The driver runs the very same :class:`~trainer.orchestration.loop.AsyncTrainingLoop`
as the local launcher (admission control, per-token staleness check, drop + re-queue,
checkpoint hooks); only three callables are swapped in:

* ``run_group`` — prompt groups are sent round-robin to :class:`RolloutWorker` actors
  (``await worker.run_group.remote(...)``); each worker builds its engine through the engine
  registry (``rollout.engine``), its environments from the task (or a given factory), and
  plays a group with the shared runner :func:`trainer.rollout.groups.run_group`;
* ``learner_step`` — ``await learner.step.remote(batch)`` on one :class:`LearnerActor`, which
  hosts any learner backend (``learner.backend``, built by
  :func:`~trainer.learner.base.make_learner`);
* ``sync_weights`` — the learner's exported policy weights are produced once in Ray's object
  store and their reference is passed to every worker (each pulls them from the store; nothing
  goes through the driver), awaited before the step is counted done.

The driver keeps its own :class:`~trainer.learner.base.Learner` as the checkpoint/eval copy:
it is filled from the learner actor before every checkpoint and at the end of RL.

Beyond one machine: start a Ray cluster (``ray start --head`` on one node, ``ray start
--address=HEAD:6379`` on the others, or any Ray cluster launcher / KubeRay), then set
``launcher.kind=ray launcher.ray_address=HEAD:6379 launcher.num_rollout_workers=N``.
Workers load the architecture and tokenizer from the model directory, so it must be
visible at the same path on every node (shared filesystem); the weights themselves
travel through the object store. For the search task set ``task.retriever_url`` to an
address every node can reach (an auto-started retriever listens on 127.0.0.1 of the
driver). GPU placement is chosen with Ray's actor options (``worker_options`` /
``learner_options``, e.g. ``{"num_gpus": 1}``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from ..engines.base import SamplingParams
from ..learner.base import Learner
from ..rollout.agent_loop import AgentLoopConfig
from ..rollout.groups import EnvPool, run_group
from ..rollout.trajectory import Trajectory
from .loop import AsyncTrainingLoop, LoopConfig
from .prompts import PromptStream

log = logging.getLogger(__name__)


class RolloutWorker:
    """Rollout worker (a Ray actor via :func:`ray.remote`): an engine from the registry + envs.

    Args:
        exp_cfg: the :class:`~trainer.config.ExperimentConfig` (engine, model settings, task).
        model_dir: ``save_pretrained`` directory giving the architecture and tokenizer.
        weights: initial policy weights (Hugging Face names; the driver's current ones).
        version: policy version of ``weights``.
        env_factory: picklable zero-argument environment factory, or ``None`` to build the task
            from ``exp_cfg`` with :func:`trainer.tasks.build_task` (its services are closed by
            :meth:`close`).
        concurrency: episodes in flight at once on this worker (environments kept).
    """

    def __init__(self, exp_cfg: Any, model_dir: str, weights: Mapping[str, torch.Tensor], version: int,
                 env_factory: Callable[[], Any] | None = None, *, concurrency: int = 8) -> None:
        from ..engines import EngineSpec, make_engine
        from ..models.loading import load_tokenizer
        from ..plugins import import_plugins

        import_plugins(exp_cfg.plugins)  # the user's registrations, in this process too
        self.tok = load_tokenizer(model_dir)
        self.handle = make_engine(exp_cfg.rollout.engine, EngineSpec(exp_cfg, Path(model_dir), self.tok,
                                                                     version, weights.items()))
        self.task = None
        if env_factory is None:
            from ..tasks import build_task
            self.task = build_task(exp_cfg)
            env_factory = self.task.make_env
        self.pool = EnvPool(env_factory, concurrency)

    @property
    def engine(self) -> Any:
        """The worker's inference engine."""
        return self.handle.engine

    async def run_group(self, uid: int, sample: Mapping[str, Any], n: int, sampling: SamplingParams,
                        agent_cfg: AgentLoopConfig) -> list[Trajectory]:
        """Play the ``n`` episodes of prompt draw ``uid`` (:func:`trainer.rollout.groups.run_group`)."""
        return await run_group(self.engine, self.pool, self.tok, sample, n, sampling, agent_cfg, uid=uid)

    async def update_weights(self, weights: Mapping[str, torch.Tensor], version: int) -> int:
        """Make the engine generate with ``weights`` as policy ``version``; returns the engine's version.

        Raises:
            EngineError: if the weights do not match the model.
        """
        await self.handle.sync(weights.items(), version)
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


class LearnerActor:
    """The learner as a Ray actor: any backend of ``learner.backend``, started from a state.

    Args:
        exp_cfg: the :class:`~trainer.config.ExperimentConfig`.
        model_dir: ``save_pretrained`` directory of the actor (architecture, initial weights).
        state: :meth:`Learner.state_dict` output to start from (models, optimizers, counters).
    """

    def __init__(self, exp_cfg: Any, model_dir: str, state: dict) -> None:
        from ..learner import make_learner
        from ..plugins import import_plugins

        import_plugins(exp_cfg.plugins)  # the user's registrations, in this process too
        self.learner = make_learner(exp_cfg, model_dir)
        self.learner.load_state_dict(state)

    def step(self, batch: Any) -> dict:
        """:meth:`Learner.step` (metrics dict)."""
        return self.learner.step(batch)

    def state_dict(self) -> dict:
        """:meth:`Learner.state_dict` (everything needed to resume)."""
        return self.learner.state_dict()

    def policy_weights(self) -> dict[str, torch.Tensor]:
        """:meth:`Learner.export_policy_weights` as a dict (what the rollout workers need)."""
        return dict(self.learner.export_policy_weights())

    def load_state_dict(self, state: dict) -> None:
        """:meth:`Learner.load_state_dict`."""
        self.learner.load_state_dict(state)


def init_ray(address: str = "", num_cpus: int | None = None) -> bool:
    """Connect to a Ray cluster (``address``) or start a local one with ``num_cpus`` CPUs.

    Returns:
        ``True`` if this call started/connected Ray (the caller should shut it down),
        ``False`` if Ray was already initialised in this process (e.g. by a test).
    """
    import ray

    if ray.is_initialized():
        return False
    ray.init(address=address or None, num_cpus=None if address else num_cpus,
             include_dashboard=False, ignore_reinit_error=True, log_to_driver=True)
    return True


class RayTrainer:
    """Asynchronous RL with Ray actors, driven by :class:`AsyncTrainingLoop` (same semantics as local).

    Args:
        exp_cfg: the :class:`~trainer.config.ExperimentConfig` (engine, learner backend, task).
        learner: the driver's :class:`~trainer.learner.base.Learner`; the learner actor starts
            from its state and it receives the learner actor's state before each checkpoint and
            after the run.
        model_dir: ``save_pretrained`` directory of the actor's architecture + tokenizer.
        tokenizer: the policy tokenizer (the driver pads batches with it).
        prompts: the :class:`PromptStream`.
        sampling: rollout sampling parameters.
        agent_cfg: episode budgets.
        loop_cfg: :class:`LoopConfig` (``concurrency`` applies per worker).
        env_factory: how each worker builds environments (default: the task of ``exp_cfg``).
        num_workers: rollout worker actors.
        start_step: steps already done (resume); also the workers' initial policy version.
        on_step / on_checkpoint / counters / weight_history: as for :class:`AsyncTrainingLoop`
            (fixed lag: snapshots of the learner actor's weights are kept by the driver).
        worker_options / learner_options: Ray actor options (``num_cpus``, ``num_gpus``, ...).

    Raises:
        ValueError: bad ``num_workers``. Ray must be initialised before :meth:`run`.
    """

    def __init__(self, exp_cfg: Any, learner: Learner, model_dir: str | Path, tokenizer: Any,
                 prompts: PromptStream, sampling: SamplingParams, agent_cfg: AgentLoopConfig,
                 loop_cfg: LoopConfig, *, env_factory: Callable[[], Any] | None = None, num_workers: int = 1,
                 start_step: int = 0, on_step: Callable[[int, dict, list[int]], None] | None = None,
                 on_checkpoint: Callable[[int, dict], None] | None = None, worker_options: dict | None = None,
                 learner_options: dict | None = None, counters: Mapping[str, int] | None = None,
                 weight_history: Mapping[int, Any] | None = None) -> None:
        if num_workers < 1:
            raise ValueError(f"launcher.num_rollout_workers={num_workers!r}: must be >= 1")
        self.exp_cfg, self.learner, self.model_dir, self.tok = exp_cfg, learner, str(model_dir), tokenizer
        self.prompts, self.sampling, self.agent_cfg, self.loop_cfg = prompts, sampling, agent_cfg, loop_cfg
        self.env_factory, self.num_workers = env_factory, num_workers
        self.start_step, self.on_step, self.on_checkpoint = start_step, on_step, on_checkpoint
        self.worker_options, self.learner_options = dict(worker_options or {}), dict(learner_options or {})
        self.counters = dict(counters or {})
        self.weight_history = weight_history
        self.workers: list[Any] = []
        self.learner_actor: Any = None
        self.loop: AsyncTrainingLoop | None = None
        self._rr = itertools.count()

    def _start_actors(self) -> None:
        import ray

        learner_cls = ray.remote(LearnerActor).options(**self.learner_options)
        self.learner_actor = learner_cls.remote(self.exp_cfg, self.model_dir, self.learner.state_dict())
        weights_ref = ray.put(dict(self.learner.export_policy_weights()))
        worker_cls = ray.remote(RolloutWorker).options(**self.worker_options)
        self.workers = [worker_cls.remote(self.exp_cfg, self.model_dir, weights_ref, self.start_step,
                                          self.env_factory, concurrency=self.loop_cfg.concurrency)
                        for _ in range(self.num_workers)]

    async def _run_group(self, uid: int, sample: Mapping[str, Any], n: int) -> list[Trajectory]:
        worker = self.workers[next(self._rr) % len(self.workers)]
        return await worker.run_group.remote(uid, dict(sample), n, self.sampling, self.agent_cfg)

    async def _learner_step(self, batch: Any, version: int) -> dict:
        return await self.learner_actor.step.remote(batch)

    async def _sync_weights(self, source: Any, version: int) -> None:
        """Push ``version`` to every worker: the learner actor's current weights when ``source``
        is the driver's learner (bounded staleness), else ``source``'s (a fixed-lag snapshot)."""
        import ray

        if source is self.learner:
            ref = self.learner_actor.policy_weights.remote()  # produced once, pulled by each worker
        else:
            ref = ray.put(dict(source.export_policy_weights()))
        await asyncio.gather(*(w.update_weights.remote(ref, version) for w in self.workers))

    async def _snapshot_weights(self, version: int) -> Any:
        return (await self.learner_actor.policy_weights.remote()).items()

    async def pull_learner_state(self) -> None:
        """Copy the learner actor's full state into the driver's learner."""
        self.learner.load_state_dict(await self.learner_actor.state_dict.remote())

    def _checkpoint(self, step: int, loop_state: dict) -> None:
        import ray

        self.learner.load_state_dict(ray.get(self.learner_actor.state_dict.remote()))
        if self.on_checkpoint is not None:
            self.on_checkpoint(step, loop_state)

    async def run(self) -> AsyncTrainingLoop:
        """Start the actors (first call), train to ``loop_cfg.total_steps``; return the finished loop.

        Afterwards the driver's learner holds the final state (actor, critic, optimizers).
        """
        if not self.workers:
            self._start_actors()
        self.loop = AsyncTrainingLoop(
            self.learner, None, None, self.tok, self.prompts, self.sampling, self.agent_cfg, self.loop_cfg,
            on_step=self.on_step, on_checkpoint=self._checkpoint, start_step=self.start_step,
            sync_weights=self._sync_weights, run_group=self._run_group, learner_step=self._learner_step,
            counters=self.counters, snapshot_weights=self._snapshot_weights,
            weight_history=self.weight_history)
        await self.loop.run()
        await self.pull_learner_state()
        return self.loop

    async def close(self) -> None:
        """Close the workers (engines, task services) and kill all actors (idempotent)."""
        import ray

        if self.workers:
            await asyncio.gather(*(w.close.remote() for w in self.workers), return_exceptions=True)
        for a in [*self.workers, self.learner_actor]:
            if a is not None:
                ray.kill(a)
        self.workers, self.learner_actor = [], None


def worker_experiment_config(cfg: Any, task: Any) -> Any:
    """``cfg`` for the workers' own :func:`build_task`: the driver's retriever server (if it has one)
    and absolute data paths."""
    from ..plugins import absolute_plugins
    from ..tasks import absolute_task_paths

    url = getattr(task, "info", {}).get("retriever_url")
    if url and not cfg.task.retriever_url:
        cfg = dataclasses.replace(cfg, task=dataclasses.replace(cfg.task, retriever_url=url))
    cfg = dataclasses.replace(cfg, plugins=absolute_plugins(cfg.plugins))
    return absolute_task_paths(cfg)  # workers may run in another working directory


async def run_ray_rl(cfg: Any, learner: Learner, model_dir: str | Path, task: Any, tokenizer: Any,
                     prompts: PromptStream, sampling: SamplingParams, agent_cfg: AgentLoopConfig,
                     loop_cfg: LoopConfig, *, start_step: int = 0,
                     on_step: Callable[[int, dict, list[int]], None] | None = None,
                     on_checkpoint: Callable[[int, dict], None] | None = None,
                     counters: Mapping[str, int] | None = None,
                     weight_history: Mapping[int, Any] | None = None) -> AsyncTrainingLoop:
    """The RL phase of ``copc train`` with ``launcher.kind=ray`` (used by :mod:`trainer.app.run`).

    Connects to ``launcher.ray_address`` (or starts a local cluster with ``launcher.ray_num_cpus``
    CPUs), runs :class:`RayTrainer` with ``launcher.num_rollout_workers`` workers that build
    their environments from ``cfg`` (reusing the driver's retriever) and their engines through
    the registry, then stops the actors (and Ray, if this call started it). The driver's
    ``learner`` ends with the final state.
    """
    import ray

    started = init_ray(cfg.launcher.ray_address, cfg.launcher.ray_num_cpus)
    trainer = RayTrainer(worker_experiment_config(cfg, task), learner, model_dir, tokenizer, prompts,
                         sampling, agent_cfg, loop_cfg, num_workers=cfg.launcher.num_rollout_workers,
                         start_step=start_step, on_step=on_step, on_checkpoint=on_checkpoint,
                         counters=counters, weight_history=weight_history)
    try:
        return await trainer.run()
    finally:
        await trainer.close()
        if started:
            ray.shutdown()
