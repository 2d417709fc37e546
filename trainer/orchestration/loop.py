"""The asynchronous training loop (local launcher): rollouts run while the learner trains.

Bounded staleness by admission control, as AReaL does: at most ``(s + 1)`` training
batches of prompt groups are admitted and not yet trained, so a group admitted at
policy version ``v`` is normally trained at version ``≤ v + s``. At consumption the
per-token staleness (learner version − version that produced each token) is checked
again: a group whose oldest token is more than ``s`` versions old is dropped,
counted in ``rollout/dropped_stale`` and its prompt re-queued, never silently lost.
``s = 0`` is synchronous on-policy training. Weights are synced to the engine after
every step (the engine swaps them between decode rounds).

Fixed lag (``staleness_mode="fixed"``, lag ``k``): batches are generated in order, batch ``n``
entirely by policy version ``max(n − k, 0)`` (kept in a :class:`~.lag.WeightHistory`; the engine
is synced to that version before the batch starts and never changes weights inside it), so the
staleness of every token trained at step ``n ≥ k`` is exactly ``k`` — an experimental condition
independent of machine speed. With ``k ≥ 1`` generating batch ``n + 1`` overlaps training step
``n``; ``k = 0`` is synchronous training, step for step the same as bounded mode with ``s = 0``.
Batches are ordered by prompt draw in both modes (reproducible, whatever the completion order).

Failures never hang the run and never become rewards:

* an episode ended by an infrastructure failure (:attr:`Trajectory.infra_failed`: the
  sandbox, retriever, reward checker or engine failed, not the policy) is not trained on:
  its whole group is dropped, counted in ``rollout/infra_failed`` and its prompt re-queued;
  when more than ``max_infra_failure_fraction`` of the last step's worth of finished
  episodes (``prompts_per_step × n_samples_per_prompt``) failed that way, the run stops
  with :class:`TrainingError`;
* any exception escaping a rollout task (a bug, a dead Ray worker) and any episode ended by
  an environment bug (:attr:`Trajectory.env_failed`) stops the run promptly with
  :class:`TrainingError` naming the prompt and the cause; the learner is idle at that
  point, so the state after the last finished step is checkpointed first (no step is lost);
* an exception of the learner step becomes a :class:`TrainingError` naming the step and
  the last checkpoint (the learner may be half-updated, so it is not checkpointed); one of
  the weight sync or a hook propagates as is.

Cumulative counters (:data:`COUNTERS`) are part of :meth:`AsyncTrainingLoop.loop_state`
and continue across a resume.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import copc

from ..engines.base import InferenceEngine, SamplingParams
from ..errors import TrainingError
from ..learner.base import Learner
from ..rollout.agent_loop import AgentLoopConfig
from ..rollout.batch import to_batch
from ..rollout.groups import EnvPool, run_group
from ..rollout.trajectory import Trajectory
from .fixed_lag import FixedLagScheduling
from .lag import WeightHistory
from .prompts import PromptStream
from .step_metrics import dropped_metrics, rollout_metrics

log = logging.getLogger(__name__)


#: Cumulative counters of a run (continued across resumes through :meth:`AsyncTrainingLoop.loop_state`):
#: ``episodes`` (episodes finished, whatever became of them), ``episodes_trained``,
#: ``tokens_generated`` / ``tokens_trained`` (model tokens, i.e. loss-mask-1 tokens),
#: ``dropped_stale`` (groups dropped as too stale), ``infra_failed`` (episodes ended by an
#: infrastructure failure), ``infra_failed_groups`` (groups dropped for one).
COUNTERS = ("episodes", "episodes_trained", "tokens_generated", "tokens_trained", "dropped_stale",
            "infra_failed", "infra_failed_groups")
#: Metric name of each counter in ``metrics.jsonl`` (logged every step, cumulative).
COUNTER_METRICS = {"episodes": "rollout/episodes_total", "episodes_trained": "rollout/episodes_trained_total",
                   "tokens_generated": "rollout/tokens_generated_total",
                   "tokens_trained": "rollout/tokens_trained_total", "dropped_stale": "rollout/dropped_stale",
                   "infra_failed": "rollout/infra_failed",
                   "infra_failed_groups": "rollout/infra_failed_groups"}


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
        max_infra_failure_fraction: stop the run when more than this fraction of a step's
            episodes (``prompts_per_step × n_samples_per_prompt``) ended by an infrastructure
            failure since the previous step (0: stop at the first one).
        staleness_mode: ``bounded`` (``max_staleness`` is a bound) or ``fixed`` (exact lag).
        fixed_lag: ``k`` of fixed mode (``max_staleness`` must equal it there).
    """

    total_steps: int
    prompts_per_step: int
    n_samples_per_prompt: int
    max_staleness: int
    concurrency: int
    checkpoint_every: int = 10
    max_infra_failure_fraction: float = 0.5
    staleness_mode: str = "bounded"
    fixed_lag: int = 0

    @classmethod
    def from_config(cls, exp: Any) -> LoopConfig:
        """From an :class:`~trainer.config.ExperimentConfig` (staleness bound: ``exp.max_staleness``)."""
        return cls(total_steps=exp.train.total_steps, prompts_per_step=exp.train.prompts_per_step,
                   n_samples_per_prompt=exp.rollout.n_samples_per_prompt, max_staleness=exp.max_staleness,
                   concurrency=exp.rollout.concurrency, checkpoint_every=exp.checkpoint.every_steps,
                   max_infra_failure_fraction=exp.train.max_infra_failure_fraction,
                   staleness_mode=exp.train.staleness_mode,
                   fixed_lag=exp.max_staleness if exp.train.staleness_mode == "fixed" else 0)

    def __post_init__(self) -> None:
        """Validate the failure threshold and the staleness mode."""
        if not 0.0 <= self.max_infra_failure_fraction <= 1.0:
            raise ValueError("LoopConfig.max_infra_failure_fraction="
                             f"{self.max_infra_failure_fraction!r}: must be in [0, 1]")
        if self.staleness_mode not in ("bounded", "fixed"):
            raise ValueError(f"LoopConfig.staleness_mode={self.staleness_mode!r}: must be 'bounded' or "
                             "'fixed'")
        if self.staleness_mode == "fixed" and not 0 <= self.fixed_lag == self.max_staleness:
            raise ValueError(f"LoopConfig.fixed_lag={self.fixed_lag!r}: must be >= 0 and equal max_staleness="
                             f"{self.max_staleness!r} in fixed mode")

    @property
    def fixed(self) -> bool:
        """Whether staleness is a fixed lag (``staleness_mode == "fixed"``)."""
        return self.staleness_mode == "fixed"


@dataclass
class _Group:
    uid: int
    trajs: list[Trajectory] = field(default_factory=list)
    batch: int = -1  # fixed lag: the step this group is generated for


class AsyncTrainingLoop(FixedLagScheduling):
    """Runs rollout producers and the learner concurrently in one process.

    Args:
        learner: any :class:`~trainer.learner.base.Learner` backend.
        engine: the rollout engine (its weights are synced after each step); unused when
            ``run_group`` is given.
        make_env: environment factory; episodes take environments from an
            :class:`~trainer.rollout.groups.EnvPool` of ``cfg.concurrency`` reusable ones.
        tokenizer: the policy tokenizer.
        prompts: the :class:`PromptStream`.
        sampling: rollout sampling parameters.
        agent_cfg: episode budgets.
        cfg: :class:`LoopConfig`.
        on_step: ``f(step, metrics, trained_uids)`` called after each step (logging).
        on_checkpoint: ``f(step, loop_state)`` called every ``checkpoint_every`` steps.
        start_step: steps already done (resume).
        sync_weights: ``async f(learner, version)`` pushing the learner's new weights to the
            engine(s) (default: ``engine.update_weights(dict(learner.export_policy_weights()),
            version)``).
        run_group: ``async f(uid, sample, n) -> list[Trajectory]`` playing ``n`` episodes of one
            prompt (default: :func:`trainer.rollout.groups.run_group` on ``engine`` in this
            process). The Ray launcher passes one that calls remote rollout workers.
        learner_step: ``async f(batch, version) -> metrics`` (default: ``learner.step(batch)``
            in a worker thread, so rollouts keep running while the learner trains; ``version``
            equals ``learner.policy_version``).
        counters: cumulative counters saved in a checkpoint's ``loop_state()["counters"]``
            (resume); missing ones start at 0.
        snapshot_weights: ``async f(version) -> (name, tensor) pairs``, the learner's current
            policy weights (fixed lag only; default ``learner.export_policy_weights()``; the Ray
            launcher pulls them from its learner actor). In fixed mode ``sync_weights`` receives a
            :class:`~.lag.WeightSnapshot` (same ``export_policy_weights()``) instead of the learner.
        weight_history: a checkpoint's ``loop_state()["weight_history"]`` (fixed lag resume).

    Raises (from :meth:`run`):
        TrainingError: a rollout task raised, or too many infrastructure failures.

    Both launchers share this class, so they have the same admission, staleness and
    consumption semantics.
    """

    def __init__(self, learner: Learner, engine: InferenceEngine | None, make_env: Callable[[], Any] | None,
                 tokenizer: Any, prompts: PromptStream, sampling: SamplingParams,
                 agent_cfg: AgentLoopConfig, cfg: LoopConfig,
                 on_step: Callable[[int, dict, list[int]], None] | None = None,
                 on_checkpoint: Callable[[int, dict], None] | None = None, start_step: int = 0,
                 sync_weights: Callable[[Any, int], Awaitable[None]] | None = None,
                 run_group: GroupRunner | None = None,
                 learner_step: Callable[[Any, int], Awaitable[dict]] | None = None,
                 counters: Mapping[str, int] | None = None,
                 snapshot_weights: Callable[[int], Awaitable[Any]] | None = None,
                 weight_history: Mapping[int, Any] | None = None) -> None:
        self.learner, self.engine, self.make_env, self.tok = learner, engine, make_env, tokenizer
        self.prompts, self.sampling, self.agent_cfg, self.cfg = prompts, sampling, agent_cfg, cfg
        self.on_step, self.on_checkpoint = on_step, on_checkpoint
        self.sync_weights = sync_weights or self._sync_engine
        self.run_group = run_group or self._local_group
        self._pool = EnvPool(make_env, cfg.concurrency) if make_env is not None else None
        self.learner_step = learner_step or self._local_step
        if learner.policy_version != start_step:
            raise ValueError(f"start_step={start_step} but the learner is at policy version "
                             f"{learner.policy_version} (restore its state first)")
        self.step = start_step
        self.version = start_step  # policy version = number of updates done
        self.in_flight: set[int] = set()  # admitted, not yet trained (running or ready)
        self.ready: list[_Group] = []
        unknown = set(counters or {}) - set(COUNTERS)
        if unknown:
            raise ValueError(f"counters: unknown key(s) {sorted(unknown)}; known: {COUNTERS}")
        self.counters: dict[str, int] = {k: int((counters or {}).get(k, 0)) for k in COUNTERS}
        self._infra_since_step = 0  # infrastructure-failed episodes since the last step
        # infra-failed flags of the last step's worth of finished episodes (the stop rule's window)
        self._recent: deque[bool] = deque(maxlen=cfg.prompts_per_step * cfg.n_samples_per_prompt)
        self._dropped_since_step: list[_Group] = []  # dropped as stale since the last step
        self._failure: TrainingError | None = None
        self._start_step = start_step
        self.last_checkpoint_step: int | None = None
        self._cond = asyncio.Condition()
        self._stop = False
        self.snapshot_weights = snapshot_weights or self._export_current
        self.history = WeightHistory(cfg.fixed_lag if cfg.fixed else 0)
        if weight_history:
            self.history.load_state_dict(dict(weight_history))
        self._engine_version = start_step  # the engine starts with the learner's weights
        self._pending: dict[int, int] = {}  # fixed lag: running prompt draw -> its batch
        self._batch_ready: dict[int, int] = {}  # fixed lag: batch -> groups ready for it
        self._batch_version: dict[int, int] = {}  # fixed lag: batch -> version generating it

    @property
    def dropped_stale(self) -> int:
        """Groups dropped as too stale so far (cumulative over resumes)."""
        return self.counters["dropped_stale"]

    @property
    def episodes_done(self) -> int:
        """Episodes finished so far (cumulative over resumes)."""
        return self.counters["episodes"]

    async def _sync_engine(self, learner: Learner, version: int) -> None:
        await self.engine.update_weights(dict(learner.export_policy_weights()), version)

    async def _export_current(self, version: int) -> Any:
        return self.learner.export_policy_weights()

    # -- producers -----------------------------------------------------------------------------
    def _may_admit(self) -> bool:
        return len(self.in_flight) < (self.cfg.max_staleness + 1) * self.cfg.prompts_per_step

    async def _local_group(self, uid: int, sample: Mapping[str, Any], n: int) -> list[Trajectory]:
        return await run_group(self.engine, self._pool, self.tok, sample, n, self.sampling, self.agent_cfg,
                               uid=uid)

    async def _local_step(self, batch: Any, version: int) -> dict:
        return await asyncio.to_thread(self.learner.step, batch)

    async def _fail(self, err: TrainingError) -> None:
        """Record the first fatal error and wake the learner side (which raises it)."""
        async with self._cond:
            if self._failure is None:
                self._failure = err
            self._stop = True
            self._cond.notify_all()

    async def _run_group(self, uid: int) -> None:
        try:
            trajs = await self.run_group(uid, self.prompts.row(uid), self.cfg.n_samples_per_prompt)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # never an unretrieved task exception: the run stops with it
            log.error("rollout of prompt draw %d failed", uid, exc_info=e)
            err = TrainingError(f"rollout of prompt draw {uid} failed: {type(e).__name__}: {e}")
            err.__cause__ = e
            await self._fail(err)
            return
        for t in trajs:
            t.info["uid"] = uid
        broken = [t for t in trajs if t.env_failed]
        if broken:  # a bug in the environment: stop rather than train on (or drop) biased data
            await self._fail(TrainingError(
                f"the environment raised on prompt draw {uid} (sample {broken[0].sample_id!r}): "
                f"{broken[0].finish_reason}"))
            return
        failed = [t for t in trajs if t.infra_failed]
        async with self._cond:
            batch = self._pending.pop(uid, -1)
            self.counters["episodes"] += len(trajs)
            self.counters["tokens_generated"] += sum(t.num_model_tokens for t in trajs)
            self._recent.extend(t.infra_failed for t in trajs)
            if not failed:
                self.ready.append(_Group(uid, list(trajs), batch))
                self._batch_ready[batch] = self._batch_ready.get(batch, 0) + 1
                self._cond.notify_all()
                return
            # an infrastructure failure is not a wrong answer: the group is not trained on
            self.counters["infra_failed"] += len(failed)
            self.counters["infra_failed_groups"] += 1
            self._infra_since_step += len(failed)
            self.in_flight.discard(uid)
            self.prompts.requeue([uid])
            self._cond.notify_all()
            per_step = self._recent.maxlen
            in_window = sum(self._recent)
            over = in_window > self.cfg.max_infra_failure_fraction * per_step
        log.warning("prompt draw %d: %d/%d episode(s) ended by an infrastructure failure (%s); "
                    "group not trained, prompt re-queued", uid, len(failed), len(trajs),
                    failed[0].finish_reason)
        if over:
            await self._fail(TrainingError(
                f"{in_window} of the last {per_step} finished episodes (a step's worth) ended by an "
                f"infrastructure failure, more than train.max_infra_failure_fraction="
                f"{self.cfg.max_infra_failure_fraction}; last: {failed[-1].finish_reason}"))

    async def _producer(self) -> None:
        tasks: set[asyncio.Task] = set()
        try:
            await self._admit(tasks)
        except asyncio.CancelledError:
            raise
        except Exception as e:
            log.error("rollout producer failed", exc_info=e)
            err = TrainingError(f"rollout producer failed: {type(e).__name__}: {e}")
            err.__cause__ = e
            await self._fail(err)
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    def _launch(self, tasks: set[asyncio.Task], uid: int) -> None:
        t = asyncio.create_task(self._run_group(uid))
        tasks.add(t)
        t.add_done_callback(tasks.discard)

    async def _admit(self, tasks: set[asyncio.Task]) -> None:
        """Admit prompt groups while the staleness bound allows and start their rollouts."""
        if self.cfg.fixed:
            await self._admit_fixed(tasks)
            return
        while not self._stop:
            async with self._cond:
                await self._cond.wait_for(lambda: self._stop or self._may_admit())
                if self._stop:
                    break
                uid = self.prompts.next()
                self.in_flight.add(uid)
            self._launch(tasks, uid)

    # -- learner -------------------------------------------------------------------------------
    def _stale(self, g: _Group) -> bool:
        vs = [t.min_version() for t in g.trajs if t.min_version() is not None]
        return bool(vs) and self.version - min(vs) > self.cfg.max_staleness

    async def _take_batch(self) -> list[_Group]:
        """The next ``prompts_per_step`` fresh groups (stale ones dropped and re-queued).

        Raises:
            TrainingError: a rollout task failed (see :meth:`_fail`).
        """
        need = self.cfg.prompts_per_step
        if self.cfg.fixed:
            return await self._take_fixed_batch()
        async with self._cond:
            while True:
                await self._cond.wait_for(lambda: self._failure is not None or len(self.ready) >= need)
                if self._failure is not None:
                    raise self._failure
                fresh = [g for g in self.ready if not self._stale(g)]
                stale = [g for g in self.ready if self._stale(g)]
                if stale:
                    self.counters["dropped_stale"] += len(stale)
                    self._dropped_since_step.extend(stale)
                    self._check_not_stuck(stale)
                    log.warning("dropping %d group(s) older than %d versions; prompts re-queued",
                                len(stale), self.cfg.max_staleness)
                    for g in stale:
                        self.in_flight.discard(g.uid)
                    self.prompts.requeue([g.uid for g in stale])
                    self._cond.notify_all()
                self.ready = fresh
                if len(self.ready) >= need:
                    batch, self.ready = self.ready[:need], self.ready[need:]
                    return sorted(batch, key=lambda g: g.uid)

    def _check_not_stuck(self, stale: list[_Group]) -> None:
        """Fail instead of spinning when rollouts stay too stale without any step in between.

        Groups admitted after a drop are generated with the engine's current weights, so they
        can only be stale again if the engine does not get new weights: more than
        ``2 (s + 1) × prompts_per_step`` drops since the last step means it is stuck.

        Raises:
            TrainingError: the engine's policy version lags the learner's.
        """
        groups_since = len(self._dropped_since_step)
        if groups_since > 2 * (self.cfg.max_staleness + 1) * self.cfg.prompts_per_step:
            oldest = min(t.min_version() for g in stale for t in g.trajs if t.min_version() is not None)
            raise TrainingError(
                f"{groups_since} groups dropped as stale since step {self.step} without any step: "
                f"rollouts come from policy version {oldest} while the learner is at {self.version} "
                f"(max staleness {self.cfg.max_staleness}); the rollout engine is not receiving "
                "weight updates")

    def loop_state(self) -> dict:
        """Resumable state: prompt stream (admitted-but-untrained prompts re-queued), step,
        version and the cumulative :data:`COUNTERS` (``"counters"``)."""
        state = {"prompts": self.prompts.state_dict(sorted(self.in_flight)), "step": self.step,
                 "version": self.version, "counters": dict(self.counters)}
        if self.cfg.fixed:
            state["weight_history"] = self.history.state_dict()
        return state

    def _save_checkpoint(self) -> None:
        if self.on_checkpoint is not None:
            self.on_checkpoint(self.step, self.loop_state())
            self.last_checkpoint_step = self.step

    def _checkpoint_before_failing(self, err: TrainingError) -> None:
        """On a rollout failure the learner is idle: checkpoint its state if not done yet."""
        if self.on_checkpoint is None:
            return
        if self.last_checkpoint_step != self.step and self.step > self._start_step:
            try:
                self._save_checkpoint()
            except Exception as e:  # the original failure is the one to report
                log.error("could not checkpoint step %d before stopping", self.step, exc_info=e)
        if self.last_checkpoint_step is not None:
            err.args = (f"{err.args[0]}; state after step {self.last_checkpoint_step} is checkpointed "
                        "(continue with --resume)",)

    async def run(self) -> None:
        """Train until ``total_steps``; returns when the last step (and its weight sync) is done.

        Raises:
            TrainingError: a rollout task raised, or too many infrastructure failures; the
                state after the last finished step is checkpointed first.
        """
        if self.cfg.fixed and self.version not in self.history:
            self.history.add(self.version, await self.snapshot_weights(self.version))
        producer = asyncio.create_task(self._producer())
        try:
            while self.step < self.cfg.total_steps:
                t_wait = time.perf_counter()
                try:
                    groups = await self._take_batch()
                except TrainingError as err:
                    self._checkpoint_before_failing(err)
                    raise
                wait_s = time.perf_counter() - t_wait
                trajs = [t for g in groups for t in g.trajs]
                batch = to_batch(trajs, self.tok.pad_token_id)
                try:
                    metrics = await self.learner_step(batch, self.version)
                except Exception as e:  # the learner may be half-updated: no checkpoint of it
                    log.error("learner step %d failed", self.step + 1, exc_info=e)
                    last = "no checkpoint yet" if self.last_checkpoint_step is None else \
                        f"the last checkpoint is step {self.last_checkpoint_step} (continue with --resume)"
                    raise TrainingError(f"learner step {self.step + 1} failed: {type(e).__name__}: {e}; "
                                        f"{last}") from e
                t_sync = time.perf_counter()
                if self.cfg.fixed:  # kept for the producer, which syncs the engine per batch; kept
                    # before the version moves, so a version the producer sees is always kept
                    self.history.add(self.version + 1, await self.snapshot_weights(self.version + 1))
                self.version += 1
                self.step += 1
                if not self.cfg.fixed:
                    await self.sync_weights(self.learner, self.version)
                uids = [g.uid for g in groups]
                async with self._cond:
                    for u in uids:
                        self.in_flight.discard(u)
                    self.counters["episodes_trained"] += len(trajs)
                    self.counters["tokens_trained"] += sum(t.num_model_tokens for t in trajs)
                    infra_step, self._infra_since_step = self._infra_since_step, 0
                    dropped, self._dropped_since_step = self._dropped_since_step, []
                    self._cond.notify_all()
                metrics.update(rollout_metrics(trajs, self.version))
                metrics.update(dropped_metrics([t for g in dropped for t in g.trajs]))
                metrics.update({"perf/wait_for_rollouts_s": wait_s,
                                "perf/weight_sync_s": time.perf_counter() - t_sync,
                                "rollout/in_flight": float(len(self.in_flight)),
                                "rollout/infra_failed_step": float(infra_step)})
                metrics.update({COUNTER_METRICS[k]: float(v) for k, v in self.counters.items()})
                if self.on_step:
                    self.on_step(self.step, metrics, uids)
                if self.on_checkpoint and (self.step % self.cfg.checkpoint_every == 0
                                           or self.step == self.cfg.total_steps):
                    self._save_checkpoint()
        finally:
            async with self._cond:
                self._stop = True
                self._cond.notify_all()
            await producer
            if self._pool is not None:
                await self._pool.close()
        if self.cfg.fixed and self._engine_version != self.version:  # the engine ends on the newest
            await self.sync_weights(self.history.get(self.version), self.version)
            self._engine_version = self.version


def make_loop_config(exp: Any, algo: copc.AlgorithmConfig | None = None) -> LoopConfig:
    """:class:`LoopConfig` from an :class:`~trainer.config.ExperimentConfig` (``algo`` is unused;
    kept for callers: the staleness bound is ``exp.max_staleness``, resolved once there)."""
    return LoopConfig.from_config(exp)
