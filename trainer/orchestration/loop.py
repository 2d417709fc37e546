"""The asynchronous training loop (local launcher): rollouts run while the learner trains.

Bounded staleness by admission control, as AReaL does: at most ``(s + 1)`` training
batches of prompt groups are admitted and not yet trained, so a group admitted at
policy version ``v`` is normally trained at version ``≤ v + s``. At consumption the
per-token staleness (learner version − version that produced each token) is checked
again: a group whose oldest token is more than ``s`` versions old is dropped,
counted in ``rollout/dropped_stale`` and its prompt re-queued, never silently lost.
``s = 0`` is synchronous on-policy training. Weights are synced to the engine after
every step (the engine swaps them between decode rounds).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import copc

from ..engines.base import InferenceEngine, SamplingParams
from ..learner.torch_learner import TorchLearner
from ..rollout.agent_loop import AgentLoopConfig, run_episode
from ..rollout.batch import to_batch
from ..rollout.trajectory import Trajectory
from .prompts import PromptStream

log = logging.getLogger(__name__)


def episode_sampling(sampling: SamplingParams, uid: int, k: int) -> SamplingParams:
    """Sampling params of episode ``k`` of prompt draw ``uid``: seed ``seed + 7919·uid + k``.

    Shared by the local and Ray launchers, so a seeded run samples the same streams whichever
    launcher plays it. Unseeded params pass through.
    """
    if sampling.seed is None:
        return sampling
    return dataclasses.replace(sampling, seed=sampling.seed + 7919 * uid + k)


#: ``async f(uid, sample, n) -> trajectories`` — plays the episodes of one prompt group.
GroupRunner = Callable[[int, Mapping[str, Any], int], Awaitable[list[Trajectory]]]


@dataclass(frozen=True)
class LoopConfig:
    """Loop settings (from :class:`trainer.config.ExperimentConfig`).

    Attributes:
        total_steps: train until this many steps (policy versions) are done.
        prompts_per_step: prompt groups per training batch.
        n_samples_per_prompt: episodes per prompt.
        max_staleness: ``s`` (0 = synchronous).
        concurrency: episodes in flight at once.
        checkpoint_every: steps between checkpoints.
    """

    total_steps: int
    prompts_per_step: int
    n_samples_per_prompt: int
    max_staleness: int
    concurrency: int
    checkpoint_every: int = 10


@dataclass
class _Group:
    uid: int
    trajs: list[Trajectory] = field(default_factory=list)


class AsyncTrainingLoop:
    """Runs rollout producers and the learner concurrently in one process.

    Args:
        learner: the :class:`TorchLearner`.
        engine: the rollout engine (its weights are synced after each step).
        make_env: environment factory (one env per episode).
        tokenizer: the policy tokenizer.
        prompts: the :class:`PromptStream`.
        sampling: rollout sampling parameters.
        agent_cfg: episode budgets.
        cfg: :class:`LoopConfig`.
        on_step: ``f(step, metrics, trained_uids)`` called after each step (logging).
        on_checkpoint: ``f(step, loop_state)`` called every ``checkpoint_every`` steps.
        start_step: steps already done (resume).
        sync_weights: ``async f(actor, version)`` pushing new weights to the engine (default:
            ``engine.update_weights(actor.state_dict(), version)``).
        run_group: ``async f(uid, sample, n) -> list[Trajectory]`` playing ``n`` episodes of one
            prompt (default: :func:`run_episode` on ``engine`` in this process). The Ray launcher
            passes one that calls remote rollout workers.
        learner_step: ``async f(batch, version) -> metrics`` (default: ``learner.step`` in a
            worker thread, so rollouts keep running while the learner trains).

    Both launchers share this class, so they have the same admission, staleness and
    consumption semantics.
    """

    def __init__(self, learner: TorchLearner, engine: InferenceEngine, make_env: Callable[[], Any],
                 tokenizer: Any, prompts: PromptStream, sampling: SamplingParams,
                 agent_cfg: AgentLoopConfig, cfg: LoopConfig,
                 on_step: Callable[[int, dict, list[int]], None] | None = None,
                 on_checkpoint: Callable[[int, dict], None] | None = None, start_step: int = 0,
                 sync_weights: Callable[[Any, int], Awaitable[None]] | None = None,
                 run_group: GroupRunner | None = None,
                 learner_step: Callable[[Any, int], Awaitable[dict]] | None = None) -> None:
        self.learner, self.engine, self.make_env, self.tok = learner, engine, make_env, tokenizer
        self.prompts, self.sampling, self.agent_cfg, self.cfg = prompts, sampling, agent_cfg, cfg
        self.on_step, self.on_checkpoint = on_step, on_checkpoint
        self.sync_weights = sync_weights or self._sync_state_dict
        self.run_group = run_group or self._local_group
        self.learner_step = learner_step or self._local_step
        self.step = start_step
        self.version = start_step  # policy version = number of updates done
        self.in_flight: set[int] = set()  # admitted, not yet trained (running or ready)
        self.ready: list[_Group] = []
        self.dropped_stale = 0
        self.episodes_done = 0
        self._cond = asyncio.Condition()
        self._sem = asyncio.Semaphore(cfg.concurrency)
        self._stop = False

    async def _sync_state_dict(self, actor: Any, version: int) -> None:
        await self.engine.update_weights(actor.state_dict(), version)

    # -- producers -----------------------------------------------------------------------------
    def _may_admit(self) -> bool:
        return len(self.in_flight) < (self.cfg.max_staleness + 1) * self.cfg.prompts_per_step

    async def _episode(self, uid: int, k: int) -> Trajectory:
        async with self._sem:
            env = self.make_env()
            try:
                sample = self.prompts.row(uid)
                sp = episode_sampling(self.sampling, uid, k)
                tr = await run_episode(self.engine, env, self.tok, sample, sp, self.agent_cfg, group_id=uid)
                tr.info["uid"] = uid
                return tr
            finally:
                close = getattr(env, "close", None)
                if close is not None:
                    await asyncio.to_thread(close)

    async def _local_group(self, uid: int, sample: Mapping[str, Any], n: int) -> list[Trajectory]:
        return list(await asyncio.gather(*(self._episode(uid, k) for k in range(n))))

    async def _local_step(self, batch: Any, version: int) -> dict:
        return await asyncio.to_thread(self.learner.step, batch, version)

    async def _run_group(self, uid: int) -> None:
        trajs = await self.run_group(uid, self.prompts.row(uid), self.cfg.n_samples_per_prompt)
        for t in trajs:
            t.info["uid"] = uid
        async with self._cond:
            self.ready.append(_Group(uid, list(trajs)))
            self.episodes_done += len(trajs)
            self._cond.notify_all()

    async def _producer(self) -> None:
        tasks: set[asyncio.Task] = set()
        try:
            while not self._stop:
                async with self._cond:
                    await self._cond.wait_for(lambda: self._stop or self._may_admit())
                    if self._stop:
                        break
                    uid = self.prompts.next()
                    self.in_flight.add(uid)
                t = asyncio.create_task(self._run_group(uid))
                tasks.add(t)
                t.add_done_callback(tasks.discard)
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    # -- learner -------------------------------------------------------------------------------
    def _stale(self, g: _Group) -> bool:
        vs = [t.min_version() for t in g.trajs if t.min_version() is not None]
        return bool(vs) and self.version - min(vs) > self.cfg.max_staleness

    async def _take_batch(self) -> list[_Group]:
        need = self.cfg.prompts_per_step
        async with self._cond:
            while True:
                await self._cond.wait_for(lambda: len(self.ready) >= need)
                fresh = [g for g in self.ready if not self._stale(g)]
                stale = [g for g in self.ready if self._stale(g)]
                if stale:
                    self.dropped_stale += len(stale)
                    log.warning("dropping %d group(s) older than %d versions; prompts re-queued",
                                len(stale), self.cfg.max_staleness)
                    for g in stale:
                        self.in_flight.discard(g.uid)
                    self.prompts.requeue([g.uid for g in stale])
                    self._cond.notify_all()
                self.ready = fresh
                if len(self.ready) >= need:
                    batch, self.ready = self.ready[:need], self.ready[need:]
                    return batch

    def loop_state(self) -> dict:
        """Resumable state: prompt stream (admitted-but-untrained prompts re-queued) and counters."""
        return {"prompts": self.prompts.state_dict(sorted(self.in_flight)), "step": self.step,
                "version": self.version, "dropped_stale": self.dropped_stale}

    async def run(self) -> None:
        """Train until ``total_steps``; returns when the last step (and its weight sync) is done."""
        producer = asyncio.create_task(self._producer())
        try:
            while self.step < self.cfg.total_steps:
                t_wait = time.perf_counter()
                groups = await self._take_batch()
                wait_s = time.perf_counter() - t_wait
                trajs = [t for g in groups for t in g.trajs]
                batch = to_batch(trajs, self.tok.pad_token_id)
                metrics = await self.learner_step(batch, self.version)
                self.version += 1
                self.step += 1
                t_sync = time.perf_counter()
                await self.sync_weights(self.learner.actor, self.version)
                uids = [g.uid for g in groups]
                async with self._cond:
                    for u in uids:
                        self.in_flight.discard(u)
                    self._cond.notify_all()
                metrics.update(self._rollout_metrics(trajs))
                metrics.update({"perf/wait_for_rollouts_s": wait_s,
                                "perf/weight_sync_s": time.perf_counter() - t_sync,
                                "rollout/dropped_stale": float(self.dropped_stale),
                                "rollout/in_flight": float(len(self.in_flight))})
                if self.on_step:
                    self.on_step(self.step, metrics, uids)
                if self.on_checkpoint and (self.step % self.cfg.checkpoint_every == 0
                                           or self.step == self.cfg.total_steps):
                    self.on_checkpoint(self.step, self.loop_state())
        finally:
            async with self._cond:
                self._stop = True
                self._cond.notify_all()
            await producer

    def _rollout_metrics(self, trajs: list[Trajectory]) -> dict[str, float]:
        n = len(trajs)
        rewards = [t.reward for t in trajs]
        reasons: dict[str, int] = {}
        for t in trajs:
            key = t.finish_reason.split(":")[0]
            reasons[key] = reasons.get(key, 0) + 1
        vers = [v for t in trajs for v, m in zip(t.versions, t.loss_mask, strict=True) if m]
        out = {"rollout/reward_mean": sum(rewards) / n,
               "rollout/accuracy": sum(r > 0.5 for r in rewards) / n,
               "rollout/response_tokens": sum(len(t.response_ids) for t in trajs) / n,
               "rollout/model_tokens": sum(t.num_model_tokens for t in trajs) / n,
               "rollout/turns": sum(t.turns for t in trajs) / n,
               "rollout/episodes": float(n)}
        out.update({f"rollout/finish_{k}": v / n for k, v in reasons.items()})
        if vers:
            out["staleness/per_token"] = [self.version - 1 - v for v in vers]  # type: ignore[assignment]
        return out


def make_loop_config(exp: Any, algo: copc.AlgorithmConfig) -> LoopConfig:
    """:class:`LoopConfig` from an :class:`~trainer.config.ExperimentConfig`."""
    own = algo.max_staleness
    return LoopConfig(total_steps=exp.train.total_steps, prompts_per_step=exp.train.prompts_per_step,
                      n_samples_per_prompt=exp.rollout.n_samples_per_prompt,
                      max_staleness=exp.train.max_staleness if own is None else own,
                      concurrency=exp.rollout.concurrency, checkpoint_every=exp.checkpoint.every_steps)


def sample_of(prompts: PromptStream, uid: int) -> Mapping[str, Any]:
    """The data row of draw ``uid`` (for logs)."""
    return prompts.row(uid)
