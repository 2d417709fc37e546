"""The Ray launcher: rollout workers and the learner as Ray actors, same loop as the local launcher.

The driver runs the very same :class:`~trainer.orchestration.loop.AsyncTrainingLoop`
as the local launcher (admission control, per-token staleness check, drop + re-queue,
checkpoint hooks); only three callables are swapped in:

* ``run_group`` — prompt groups are sent round-robin to :class:`RolloutWorker` actors
  (``await worker.run_group.remote(...)``); each worker owns a model copy, an
  :class:`~trainer.engines.embedded.EmbeddedEngine` and an environment factory and
  plays the ``n`` episodes of a group concurrently;
* ``learner_step`` — ``await learner.step.remote(batch, version)`` on one
  :class:`LearnerActor` (a :class:`~trainer.learner.torch_learner.TorchLearner`);
* ``sync_weights`` — the learner's new actor state dict is produced once in Ray's
  object store and its reference is passed to every worker (each pulls it from the
  store; nothing goes through the driver), awaited before the step is counted done.

The driver keeps its own :class:`TorchLearner` as the checkpoint/eval copy: it is
filled from the learner actor before every checkpoint and at the end of RL.

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

import copc

from ..engines.base import SamplingParams
from ..learner.torch_learner import LearnerConfig, TorchLearner
from ..rollout.agent_loop import AgentLoopConfig, run_episode
from ..rollout.trajectory import Trajectory
from .loop import AsyncTrainingLoop, LoopConfig, episode_sampling
from .prompts import PromptStream

log = logging.getLogger(__name__)


class RolloutWorker:
    """Rollout worker (a Ray actor via :func:`ray.remote`): model copy + embedded engine + envs.

    Args:
        model_dir: ``save_pretrained`` directory giving the architecture and tokenizer.
        state: initial actor state dict (the driver's current weights).
        version: policy version of ``state``.
        env_factory: picklable zero-argument environment factory, or ``None`` to build the task
            from ``exp_cfg`` with :func:`trainer.tasks.build_task` (its services are closed by
            :meth:`close`).
        exp_cfg: :class:`~trainer.config.ExperimentConfig` (used iff ``env_factory`` is ``None``).
        concurrency: episodes in flight at once on this worker.
        engine_max_batch_size: embedded engine batch size (sequences).
        attn_implementation, dtype: passed to :func:`~trainer.models.loading.load_model_and_tokenizer`.

    Raises:
        ValueError: if neither or both of ``env_factory`` and ``exp_cfg`` are given.
    """

    def __init__(self, model_dir: str, state: Mapping[str, torch.Tensor], version: int,
                 env_factory: Callable[[], Any] | None = None, exp_cfg: Any = None, *,
                 concurrency: int = 8, engine_max_batch_size: int = 32,
                 attn_implementation: str = "eager", dtype: torch.dtype = torch.float32) -> None:
        from ..engines.embedded import EmbeddedEngine, EmbeddedEngineConfig
        from ..models.loading import load_model_and_tokenizer

        if (env_factory is None) == (exp_cfg is None):
            raise ValueError("RolloutWorker: give exactly one of env_factory and exp_cfg "
                             f"(got env_factory={env_factory!r}, exp_cfg={type(exp_cfg).__name__})")
        model, self.tok = load_model_and_tokenizer(model_dir, dtype=dtype,
                                                   attn_implementation=attn_implementation)
        model.load_state_dict(state, strict=True)
        self.engine = EmbeddedEngine(model, self.tok, EmbeddedEngineConfig(
            max_batch_size=engine_max_batch_size), version=version)
        self.task = None
        if env_factory is None:
            from ..tasks import build_task
            self.task = build_task(exp_cfg)
            env_factory = self.task.make_env
        self.make_env = env_factory
        self._sem = asyncio.Semaphore(concurrency)

    async def _episode(self, uid: int, k: int, sample: Mapping[str, Any], sampling: SamplingParams,
                       agent_cfg: AgentLoopConfig) -> Trajectory:
        async with self._sem:
            env = self.make_env()
            try:
                tr = await run_episode(self.engine, env, self.tok, sample, episode_sampling(sampling, uid, k),
                                       agent_cfg, group_id=uid)
                tr.info["uid"] = uid
                return tr
            finally:
                close = getattr(env, "close", None)
                if close is not None:
                    await asyncio.to_thread(close)

    async def run_group(self, uid: int, sample: Mapping[str, Any], n: int, sampling: SamplingParams,
                        agent_cfg: AgentLoopConfig) -> list[Trajectory]:
        """Play the ``n`` episodes of prompt draw ``uid`` concurrently; ``group_id = uid``."""
        return list(await asyncio.gather(*(self._episode(uid, k, sample, sampling, agent_cfg)
                                           for k in range(n))))

    async def update_weights(self, state: Mapping[str, torch.Tensor], version: int) -> int:
        """Load ``state`` into the engine as policy ``version`` (between decode rounds); returns it.

        Raises:
            EngineError: if the state dict does not match the model.
        """
        await self.engine.update_weights(state, version)
        return self.engine.version

    async def version(self) -> int:
        """The engine's current policy version."""
        return self.engine.version

    async def engine_state_dict(self) -> dict[str, torch.Tensor]:
        """The engine's weights (to check that a sync arrived)."""
        return {k: v.detach().clone() for k, v in self.engine.model.state_dict().items()}

    async def close(self) -> None:
        """Stop the engine and release the task's services (sandbox, ...)."""
        await self.engine.close()
        if self.task is not None:
            await asyncio.to_thread(self.task.close)


class LearnerActor:
    """The learner as a Ray actor: a :class:`TorchLearner` built from a model directory + state.

    Args:
        model_dir: ``save_pretrained`` directory of the actor (architecture).
        algo: the algorithm.
        cfg: :class:`LearnerConfig`.
        state: :meth:`TorchLearner.state_dict` output to start from (actor, critic, optimizers,
            schedulers, step counter).
        attn_implementation, dtype: as for :func:`~trainer.models.loading.load_model_and_tokenizer`.
        gradient_checkpointing: enable it on the actor (as the driver's actor has it).
    """

    def __init__(self, model_dir: str, algo: copc.AlgorithmConfig, cfg: LearnerConfig, state: dict,
                 attn_implementation: str = "eager", dtype: torch.dtype = torch.float32,
                 gradient_checkpointing: bool = False) -> None:
        from ..models.loading import load_model_and_tokenizer

        actor, _ = load_model_and_tokenizer(model_dir, dtype=dtype, attn_implementation=attn_implementation)
        if gradient_checkpointing:
            actor.gradient_checkpointing_enable()
        self.learner = TorchLearner(actor, algo, cfg)
        self.learner.load_state_dict(state)

    def step(self, batch: Any, version: int) -> dict:
        """:meth:`TorchLearner.step` (metrics dict)."""
        return self.learner.step(batch, version)

    def state_dict(self) -> dict:
        """:meth:`TorchLearner.state_dict` (everything needed to resume)."""
        return self.learner.state_dict()

    def actor_state_dict(self) -> dict[str, torch.Tensor]:
        """The actor's weights (what the rollout workers need)."""
        return self.learner.actor.state_dict()

    def load_state_dict(self, state: dict) -> None:
        """:meth:`TorchLearner.load_state_dict`."""
        self.learner.load_state_dict(state)


def _checkpointing(model: Any) -> bool:
    """Whether activation (gradient) checkpointing is on (new and old ``transformers`` names)."""
    flag = getattr(model, "is_activation_checkpointing", None)
    return bool(getattr(model, "is_gradient_checkpointing", False) if flag is None else flag)


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
        learner: the driver's :class:`TorchLearner`; the learner actor starts from its state and
            it receives the learner actor's state before each checkpoint and after the run.
        model_dir: ``save_pretrained`` directory of the actor's architecture + tokenizer.
        tokenizer: the policy tokenizer (the driver pads batches with it).
        prompts: the :class:`PromptStream`.
        sampling: rollout sampling parameters.
        agent_cfg: episode budgets.
        loop_cfg: :class:`LoopConfig` (``concurrency`` applies per worker).
        env_factory / exp_cfg: how each worker builds environments (see :class:`RolloutWorker`).
        num_workers: rollout worker actors.
        start_step: steps already done (resume); also the workers' initial policy version.
        on_step / on_checkpoint / counters: as for :class:`AsyncTrainingLoop`.
        engine_max_batch_size, attn_implementation: per worker.
        worker_options / learner_options: Ray actor options (``num_cpus``, ``num_gpus``, ...).

    Raises:
        ValueError: bad ``num_workers`` or env source. Ray must be initialised before :meth:`run`.
    """

    def __init__(self, learner: TorchLearner, model_dir: str | Path, tokenizer: Any, prompts: PromptStream,
                 sampling: SamplingParams, agent_cfg: AgentLoopConfig, loop_cfg: LoopConfig, *,
                 env_factory: Callable[[], Any] | None = None, exp_cfg: Any = None, num_workers: int = 1,
                 start_step: int = 0, on_step: Callable[[int, dict, list[int]], None] | None = None,
                 on_checkpoint: Callable[[int, dict], None] | None = None, engine_max_batch_size: int = 32,
                 attn_implementation: str = "eager", worker_options: dict | None = None,
                 learner_options: dict | None = None, counters: Mapping[str, int] | None = None) -> None:
        if num_workers < 1:
            raise ValueError(f"launcher.num_rollout_workers={num_workers!r}: must be >= 1")
        if (env_factory is None) == (exp_cfg is None):
            raise ValueError("RayTrainer: give exactly one of env_factory and exp_cfg")
        self.learner, self.model_dir, self.tok = learner, str(model_dir), tokenizer
        self.prompts, self.sampling, self.agent_cfg, self.loop_cfg = prompts, sampling, agent_cfg, loop_cfg
        self.env_factory, self.exp_cfg, self.num_workers = env_factory, exp_cfg, num_workers
        self.start_step, self.on_step, self.on_checkpoint = start_step, on_step, on_checkpoint
        self.engine_max_batch_size, self.attn = engine_max_batch_size, attn_implementation
        self.worker_options, self.learner_options = dict(worker_options or {}), dict(learner_options or {})
        self.counters = dict(counters or {})
        self.workers: list[Any] = []
        self.learner_actor: Any = None
        self.loop: AsyncTrainingLoop | None = None
        self._rr = itertools.count()

    def _start_actors(self) -> None:
        import ray

        dtype = next(self.learner.actor.parameters()).dtype  # same precision as the driver's actor
        learner_cls = ray.remote(LearnerActor).options(**self.learner_options)
        self.learner_actor = learner_cls.remote(
            self.model_dir, self.learner.algo, self.learner.cfg, self.learner.state_dict(), self.attn, dtype,
            _checkpointing(self.learner.actor))
        state_ref = ray.put(self.learner.actor.state_dict())
        worker_cls = ray.remote(RolloutWorker).options(**self.worker_options)
        self.workers = [worker_cls.remote(self.model_dir, state_ref, self.start_step, self.env_factory,
                                          self.exp_cfg, concurrency=self.loop_cfg.concurrency,
                                          engine_max_batch_size=self.engine_max_batch_size,
                                          attn_implementation=self.attn, dtype=dtype)
                        for _ in range(self.num_workers)]

    async def _run_group(self, uid: int, sample: Mapping[str, Any], n: int) -> list[Trajectory]:
        worker = self.workers[next(self._rr) % len(self.workers)]
        return await worker.run_group.remote(uid, dict(sample), n, self.sampling, self.agent_cfg)

    async def _learner_step(self, batch: Any, version: int) -> dict:
        return await self.learner_actor.step.remote(batch, version)

    async def _sync_weights(self, _driver_actor: Any, version: int) -> None:
        ref = self.learner_actor.actor_state_dict.remote()  # produced once, pulled by each worker
        await asyncio.gather(*(w.update_weights.remote(ref, version) for w in self.workers))

    async def pull_learner_state(self) -> None:
        """Copy the learner actor's full state into the driver's :class:`TorchLearner`."""
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
            counters=self.counters)
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
    """``cfg`` for the workers' own :func:`build_task`: reuse the driver's retriever server if it has one."""
    url = getattr(task, "info", {}).get("retriever_url")
    if url and not cfg.task.retriever_url:
        return dataclasses.replace(cfg, task=dataclasses.replace(cfg.task, retriever_url=url))
    return cfg


async def run_ray_rl(cfg: Any, learner: TorchLearner, model_dir: str | Path, task: Any, tokenizer: Any,
                     prompts: PromptStream, sampling: SamplingParams, agent_cfg: AgentLoopConfig,
                     loop_cfg: LoopConfig, *, start_step: int = 0,
                     on_step: Callable[[int, dict, list[int]], None] | None = None,
                     on_checkpoint: Callable[[int, dict], None] | None = None,
                     counters: Mapping[str, int] | None = None) -> AsyncTrainingLoop:
    """The RL phase of ``copc train`` with ``launcher.kind=ray`` (used by :mod:`trainer.run`).

    Connects to ``launcher.ray_address`` (or starts a local cluster with ``launcher.ray_num_cpus``
    CPUs), runs :class:`RayTrainer` with ``launcher.num_rollout_workers`` workers that build
    their environments from ``cfg`` (reusing the driver's retriever), then stops the actors
    (and Ray, if this call started it). The driver's ``learner`` ends with the final state.

    Raises:
        ValueError: ``rollout.engine`` other than ``embedded`` (workers own an embedded engine).
    """
    if cfg.rollout.engine != "embedded":
        raise ValueError(f"rollout.engine={cfg.rollout.engine!r}: launcher.kind='ray' supports "
                         "only 'embedded' rollout workers")
    import ray

    started = init_ray(cfg.launcher.ray_address, cfg.launcher.ray_num_cpus)
    trainer = RayTrainer(learner, model_dir, tokenizer, prompts, sampling, agent_cfg, loop_cfg,
                         exp_cfg=worker_experiment_config(cfg, task),
                         num_workers=cfg.launcher.num_rollout_workers, start_step=start_step,
                         on_step=on_step, on_checkpoint=on_checkpoint,
                         engine_max_batch_size=cfg.rollout.engine_max_batch_size,
                         attn_implementation=cfg.model.attn_implementation, counters=counters)
    try:
        return await trainer.run()
    finally:
        await trainer.close()
        if started:
            ray.shutdown()
