"""The asynchronous training loop: rollouts run while the learner trains.

:class:`AsyncTrainingLoop` takes objects: a :class:`~trainer.learner.base.Learner`, a
:class:`~.rollouts.Rollouts` (local engine + environments, or Ray rollout workers), the
:class:`~.prompts.PromptStream`, a :class:`LoopConfig` (whose ``staleness`` is a strategy of
:mod:`.staleness`: bounded admission or a fixed lag), :class:`~.rollouts.LoopHooks` (logging,
checkpoints) and the explicit :class:`~.state.LoopState` (step, version, counters, kept
versions; :meth:`LoopState.resume <.state.LoopState.resume>` of a checkpoint). Both launchers
run this class, so they have the same admission, staleness and consumption semantics.

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

Cumulative counters (:data:`~.state.COUNTERS`) and the per-version reward tallies
(``rollout/*_by_version_total/v<k>``, :mod:`trainer.outputs.by_version`) are part of the
checkpointed loop state and continue across a resume.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from ..errors import TrainingError
from ..learner.allocator import release_free_heap
from ..learner.base import Learner
from ..models.lora import adapter_of
from ..rollout.batch import to_batch
from .attestation import SyncAttestor, SyncCheck
from .group_filter import GroupFilter
from .prompts import PromptStream
from .rollouts import LoopHooks, Rollouts, WeightSource
from .staleness import BoundedAdmission, FixedLag, Staleness
from .state import COUNTER_METRICS, COUNTERS, Group, LoopState
from .step_metrics import by_version_metrics, dropped_metrics, rollout_metrics
from .truncation import TruncationMonitor, TruncationSettings

__all__ = ["COUNTERS", "COUNTER_METRICS", "AsyncTrainingLoop", "BoundedAdmission", "FixedLag", "LoopConfig",
           "LoopState", "TrainingError"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LoopConfig:
    """Loop settings (built from the experiment config by :func:`trainer.app.assemble.loop_config`).

    Attributes:
        total_steps: train until this many steps (policy versions) are done.
        prompts_per_step: prompt groups per training batch.
        n_samples_per_prompt: episodes per prompt.
        pad_token_id: the tokenizer's pad id (batches are padded with it).
        staleness: the strategy (:class:`~.staleness.BoundedAdmission` or
            :class:`~.staleness.FixedLag`).
        checkpoint_every: steps between checkpoints.
        max_infra_failure_fraction: stop the run when more than this fraction of a step's
            episodes (``prompts_per_step × n_samples_per_prompt``) ended by an infrastructure
            failure since the previous step (0: stop at the first one).
        sync_check: the weight-sync attestation after every sync of the rollouts' weights
            (:mod:`.attestation`; both staleness modes), None: off.
        eval_every: call ``hooks.evaluate(step)`` after every this many steps (not after the last:
            the run's own after-RL evaluation covers it), 0: never.
        malloc_trim: after every learner step, return this process's free C heap to the OS
            (``learner.malloc_trim``; :func:`~trainer.learner.allocator.release_free_heap`).
        group_filter: dynamic sampling (``train.filter_groups``, :mod:`.group_filter`): finished
            groups whose episodes all got one reward are dropped and replaced; None: off.
        truncation: the token caps and when to warn that they cut most of a step's episodes
            (:mod:`.truncation`); None: no warning (the metrics are logged either way).

    Raises:
        ValueError: a failure fraction outside [0, 1], or a staleness that is no strategy.
    """

    total_steps: int
    prompts_per_step: int
    n_samples_per_prompt: int
    pad_token_id: int
    staleness: Staleness = field(default_factory=lambda: BoundedAdmission(8))
    checkpoint_every: int = 10
    max_infra_failure_fraction: float = 0.5
    sync_check: SyncCheck | None = None
    eval_every: int = 0
    malloc_trim: bool = False
    group_filter: GroupFilter | None = None
    truncation: TruncationSettings | None = None

    def __post_init__(self) -> None:
        """Validate the failure threshold and the staleness strategy."""
        if not 0.0 <= self.max_infra_failure_fraction <= 1.0:
            raise ValueError("LoopConfig.max_infra_failure_fraction="
                             f"{self.max_infra_failure_fraction!r}: must be in [0, 1]")
        if not isinstance(self.staleness, BoundedAdmission | FixedLag):
            raise ValueError(f"LoopConfig.staleness={self.staleness!r}: must be a BoundedAdmission or a "
                             "FixedLag")


class AsyncTrainingLoop:
    """Runs rollout producers and the learner concurrently on one event loop.

    Args:
        learner: any :class:`~trainer.learner.base.Learner` (a Ray-hosted one included); its
            :meth:`~trainer.learner.base.Learner.step` runs in a worker thread, so rollouts keep
            running while it trains.
        rollouts: the :class:`~.rollouts.Rollouts` episodes are played through (closed by the
            caller, who built them).
        prompts: the :class:`PromptStream` (its cursor restored on resume).
        cfg: :class:`LoopConfig`.
        hooks: :class:`~.rollouts.LoopHooks` (default: no logging, no checkpoints).
        state: the :class:`~.state.LoopState` to continue from (default: a new run at step 0).

    Raises:
        ValueError: the learner's policy version is not the state's step.
        TrainingError (from :meth:`run`): a rollout task raised, too many infrastructure
            failures, or the learner step failed.
    """

    def __init__(self, learner: Learner, rollouts: Rollouts, prompts: PromptStream, cfg: LoopConfig,
                 hooks: LoopHooks | None = None, state: LoopState | None = None) -> None:
        self.learner, self.rollouts, self.prompts, self.cfg = learner, rollouts, prompts, cfg
        self.hooks = hooks or LoopHooks()
        self.state = state or LoopState()
        if learner.policy_version != self.state.step:
            raise ValueError(f"start step {self.state.step} but the learner is at policy version "
                             f"{learner.policy_version} (restore its state first)")
        self.state.recent = deque(self.state.recent, maxlen=cfg.prompts_per_step * cfg.n_samples_per_prompt)
        # a kept LoRA version reaches an engine without adapter sync merged into the learner's base
        self.state.history.merge = getattr(learner, "merged_weights", None)
        self._tasks: set[asyncio.Task] = set()
        self.attestor = SyncAttestor(cfg.sync_check, rollouts, learner, keep=cfg.staleness.versions + 2)
        self._sync_wait_s = 0.0  # perf/sync_check_wait_s: time syncs waited for older checks
        self._truncation = TruncationMonitor(cfg.truncation) if cfg.truncation else None
        self._last_step_end: float | None = None  # perf/step_s: wall time between two steps' ends

    # -- the services a staleness strategy uses (:class:`~.staleness.LoopServices`) ---------------
    @property
    def prompts_per_step(self) -> int:
        """``cfg.prompts_per_step``."""
        return self.cfg.prompts_per_step

    @property
    def total_steps(self) -> int:
        """``cfg.total_steps``."""
        return self.cfg.total_steps

    def launch(self, uid: int) -> None:
        """Start the rollout task of prompt draw ``uid``."""
        t = asyncio.create_task(self._run_group(uid))
        self._tasks.add(t)
        t.add_done_callback(self._tasks.discard)

    async def sync(self, source: WeightSource, version: int) -> None:
        """``rollouts.sync(source, version)``, then the attestation of that sync starts."""
        await self.rollouts.sync(source, version)
        self._sync_wait_s += await self.attestor.synced(version)

    async def snapshot(self, version: int) -> None:
        """Keep the learner's current weights as ``version`` — a LoRA learner's adapter only
        (exported in a worker thread: a remote learner's arrive while rollouts go on)."""
        def export() -> Any:
            adapter = adapter_of(self.learner)
            return adapter.copy("cpu") if adapter is not None else list(self.learner.export_policy_weights())

        self.state.history.add(version, await asyncio.to_thread(export))

    # -- progress ------------------------------------------------------------------------------
    @property
    def step(self) -> int:
        """Steps done (``state.step``)."""
        return self.state.step

    @property
    def version(self) -> int:
        """The learner's policy version (``state.version``)."""
        return self.state.version

    @property
    def counters(self) -> dict[str, int]:
        """The cumulative counters (``state.counters``)."""
        return self.state.counters

    def loop_state(self) -> dict:
        """Resumable state (:meth:`LoopState.checkpoint <.state.LoopState.checkpoint>`)."""
        return self.state.checkpoint(self.prompts, self.cfg.staleness.keeps_weights)

    async def take_batch(self) -> list[Group]:
        """The next batch of the staleness strategy (:meth:`~.staleness.BoundedAdmission.take_batch`)."""
        return await self.cfg.staleness.take_batch(self)

    # -- producers -----------------------------------------------------------------------------
    async def _fail(self, err: TrainingError) -> None:
        """Record the first fatal error and wake the learner side (which raises it)."""
        st = self.state
        async with st.cond:
            if st.failure is None:
                st.failure = err
            st.stop = True
            st.cond.notify_all()

    async def _run_group(self, uid: int) -> None:
        try:
            trajs = await self.rollouts.run_group(uid, self.prompts.row(uid), self.cfg.n_samples_per_prompt)
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
        await self._finished(uid, trajs)

    async def _finished(self, uid: int, trajs: list) -> None:
        """Count a finished group; a ready one joins ``state.ready``, an infra-failed one is re-queued."""
        st = self.state
        failed = [t for t in trajs if t.infra_failed]
        async with st.cond:
            batch = st.pending.pop(uid, -1)
            st.counters["episodes"] += len(trajs)
            st.counters["tokens_generated"] += sum(t.num_model_tokens for t in trajs)
            st.recent.extend(t.infra_failed for t in trajs)
            if not failed:
                if not self._filtered(uid, trajs, batch):
                    st.ready.append(Group(uid, list(trajs), batch))
                    st.batch_ready[batch] = st.batch_ready.get(batch, 0) + 1
                    st.cond.notify_all()
                return
            # an infrastructure failure is not a wrong answer: the group is not trained on
            st.counters["infra_failed"] += len(failed)
            st.counters["infra_failed_groups"] += 1
            st.infra_since_step += len(failed)
            st.in_flight.discard(uid)
            self.prompts.requeue([uid])
            st.cond.notify_all()
            per_step = st.recent.maxlen
            in_window = sum(st.recent)
            over = in_window > self.cfg.max_infra_failure_fraction * per_step
        log.warning("prompt draw %d: %d/%d episode(s) ended by an infrastructure failure (%s); "
                    "group not trained, prompt re-queued", uid, len(failed), len(trajs),
                    failed[0].finish_reason)
        if over:
            await self._fail(TrainingError(
                f"{in_window} of the last {per_step} finished episodes (a step's worth) ended by an "
                f"infrastructure failure, more than train.max_infra_failure_fraction="
                f"{self.cfg.max_infra_failure_fraction}; last: {failed[-1].finish_reason}"))

    def _filtered(self, uid: int, trajs: list, batch: int) -> bool:
        """Dynamic sampling, under ``state.cond``: drop a finished group whose episodes all got one
        reward (:class:`~.group_filter.GroupFilter`); its prompt is consumed, the staleness strategy
        draws a replacement. True when dropped."""
        flt, st = self.cfg.group_filter, self.state
        if flt is None:
            return False
        done = st.filtered.get(batch, 0)
        if not flt.drops(trajs, done):
            return False
        st.filtered[batch] = done + 1
        st.filtered_since_step += 1
        st.counters["filtered_groups"] += 1
        st.in_flight.discard(uid)
        st.cond.notify_all()
        if done + 1 == flt.max_per_batch:
            log.warning("dynamic sampling dropped %d groups for batch %s "
                        "(train.max_filtered_groups_per_batch); it now keeps groups whatever their "
                        "rewards", done + 1, batch)
        return True

    async def _producer(self) -> None:
        try:
            await self.cfg.staleness.admit(self)
        except asyncio.CancelledError:
            raise
        except Exception as e:
            log.error("rollout producer failed", exc_info=e)
            err = TrainingError(f"rollout producer failed: {type(e).__name__}: {e}")
            err.__cause__ = e
            await self._fail(err)
        finally:
            tasks = list(self._tasks)
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    # -- learner -------------------------------------------------------------------------------
    def _save_checkpoint(self) -> None:
        if self.hooks.save_checkpoint(self.state.step, self.loop_state()):
            self.state.last_checkpoint_step = self.state.step

    def _checkpoint_before_failing(self, err: TrainingError) -> None:
        """On a rollout failure the learner is idle: checkpoint its state if not done yet."""
        st = self.state
        if st.last_checkpoint_step != st.step and st.step > st.start_step:
            try:
                self._save_checkpoint()
            except Exception as e:  # the original failure is the one to report
                log.error("could not checkpoint step %d before stopping", st.step, exc_info=e)
        if st.last_checkpoint_step is not None:
            err.args = (f"{err.args[0]}; state after step {st.last_checkpoint_step} is checkpointed "
                        "(continue with --resume)",)

    async def _learner_step(self, batch: Any) -> dict:
        """``learner.step(batch)`` in a worker thread; a failure becomes a :class:`TrainingError`."""
        try:
            metrics = await asyncio.to_thread(self.learner.step, batch)
        except Exception as e:  # the learner may be half-updated: no checkpoint of it
            log.error("learner step %d failed", self.state.step + 1, exc_info=e)
            done = self.state.last_checkpoint_step
            last = "no checkpoint yet" if done is None else \
                f"the last checkpoint is step {done} (continue with --resume)"
            raise TrainingError(f"learner step {self.state.step + 1} failed: {type(e).__name__}: {e}; "
                                f"{last}") from e
        if self.cfg.malloc_trim:  # the step's freed activations leave the resident set
            t0 = time.perf_counter()
            await asyncio.to_thread(release_free_heap)
            metrics["perf/malloc_trim_s"] = time.perf_counter() - t0
        return metrics

    async def _train_step(self) -> None:
        """Take a batch, train on it, move the version, report and checkpoint."""
        st, strategy = self.state, self.cfg.staleness
        t_wait = time.perf_counter()
        try:
            groups = await self.take_batch()
        except TrainingError as err:
            await self.attestor.collect(wait=True, timeout_s=5.0)  # a failed sync check explains it better
            self._checkpoint_before_failing(err)
            raise
        wait_s = time.perf_counter() - t_wait
        checked = await self.attestor.collect()  # the checks of earlier syncs that finished
        trajs = [t for g in groups for t in g.trajs]
        metrics = await self._learner_step(to_batch(trajs, self.cfg.pad_token_id))
        metrics.update(checked)
        metrics["perf/sync_check_ref_s"] = await self.attestor.reference(st.version + 1)
        t_samples = time.perf_counter()
        self.hooks.on_trained(st.step + 1, trajs, self.learner)
        metrics["perf/samples_s"] = time.perf_counter() - t_samples
        t_sync = time.perf_counter()
        await strategy.before_new_version(self)
        st.version += 1
        st.step += 1
        await strategy.after_new_version(self)
        uids = [g.uid for g in groups]
        async with st.cond:
            for u in uids:
                st.in_flight.discard(u)
            st.counters["episodes_trained"] += len(trajs)
            st.counters["tokens_trained"] += sum(t.num_model_tokens for t in trajs)
            infra_step, st.infra_since_step = st.infra_since_step, 0
            dropped, st.dropped_since_step = st.dropped_since_step, []
            filtered_step, st.filtered_since_step = st.filtered_since_step, 0
            surplus_step, st.surplus_since_step = st.surplus_since_step, 0
            for b in [b for b in st.filtered if b < st.step]:  # trained (fixed lag) or bounded (-1)
                del st.filtered[b]
            st.cond.notify_all()
        metrics.update(rollout_metrics(trajs, st.version))
        metrics.update(by_version_metrics(trajs, st.by_version))  # and the run's tallies (state.by_version)
        if self._truncation is not None:  # one line when a token cap cut most episodes (rate-limited)
            self._truncation.observe(st.step, metrics)
        metrics.update(dropped_metrics([t for g in dropped for t in g.trajs]))
        metrics.update({"perf/wait_for_rollouts_s": wait_s,
                        "perf/weight_sync_s": time.perf_counter() - t_sync,
                        "perf/sync_check_wait_s": self._take_sync_wait(),
                        "rollout/in_flight": float(len(st.in_flight)),
                        "rollout/infra_failed_step": float(infra_step),
                        "rollout/filtered_groups_step": float(filtered_step),
                        "rollout/surplus_groups_step": float(surplus_step),
                        "rollout/groups_trained": float(len(groups))})
        metrics.update({COUNTER_METRICS[k]: float(v) for k, v in st.counters.items()})
        metrics.update(self._step_time(sum(t.num_model_tokens for t in trajs)))
        every = self.cfg.eval_every
        if every and st.step % every == 0 and st.step < self.cfg.total_steps:
            metrics.update(await self._evaluate(st.step))
        self.hooks.on_step(st.step, metrics, uids)
        if st.step % self.cfg.checkpoint_every == 0 or st.step == self.cfg.total_steps:
            self._save_checkpoint()

    def _step_time(self, tokens: int) -> dict[str, float]:
        """``perf/step_s``: seconds since the previous step ended (the first step: since
        :meth:`run` started), and ``perf/tokens_per_s``: the step's trained model tokens over it
        (the throughput of the paper's Table 3; per device: ``copc train`` divides)."""
        now = time.perf_counter()
        step_s, self._last_step_end = now - (self._last_step_end or now), now
        return {"perf/step_s": step_s, "perf/tokens_per_s": tokens / step_s if step_s > 0 else 0.0}

    async def _evaluate(self, step: int) -> dict[str, float]:
        """``hooks.evaluate(step)`` between two batches; a failure is logged and counted
        (``eval/failed``), never a training failure. ``perf/eval_s``: its wall time."""
        t0 = time.perf_counter()
        try:
            out = dict(await self.hooks.evaluate(step))
        except Exception as e:  # an evaluation problem must not end the run
            log.error("evaluation after step %d failed: %s: %s", step, type(e).__name__, e)
            out = {"eval/failed": 1.0}
        out["perf/eval_s"] = time.perf_counter() - t0
        return out

    def _take_sync_wait(self) -> float:
        """Seconds syncs waited for older attestation checks since the previous step (reset)."""
        waited, self._sync_wait_s = self._sync_wait_s, 0.0
        return waited

    async def run(self) -> None:
        """Train until ``total_steps``; returns when the last step (and its weight sync) is done.

        Raises:
            TrainingError: a rollout task raised, or too many infrastructure failures (the state
                after the last finished step is checkpointed first), or the learner step failed.
        """
        st = self.state
        self._last_step_end = time.perf_counter()
        await self.attestor.reference(st.version)  # before any sync can need it
        await self.attestor.startup()  # the engine serves the learner's weights (before calibrating on them)
        await self.attestor.calibrate(st.version)  # a bf16 engine's tolerance, before any episode runs
        await self.cfg.staleness.start(self)
        self.attestor.unreferenced(st.history.versions(), st.version)  # a resume's kept versions
        producer = asyncio.create_task(self._producer())
        try:
            while st.step < self.cfg.total_steps:
                await self._train_step()
        except BaseException:
            self.attestor.cancel()
            raise
        finally:
            async with st.cond:
                st.stop = True
                st.cond.notify_all()
            await producer
        await self.cfg.staleness.finish(self)
        last = await self.attestor.collect(wait=True)  # every sync is checked, the last one too
        if last:
            log.info("weight syncs up to the final version %d attested: %s", st.version, last)
