"""Staleness strategies of the training loop: bounded admission or a fixed lag, over a :class:`LoopState`.

A strategy decides which prompt groups are admitted, with which policy weights the rollouts
generate, and which finished groups make the next batch. It keeps no state of its own: it reads
and writes the loop's explicit :class:`~.state.LoopState` (under ``state.cond``) and uses the
loop's services (:class:`LoopServices`: start a rollout, sync the rollouts' weights, snapshot the
learner's weights). Built from the config's ``train.staleness`` by :func:`staleness_strategy`.

The settings are the config's one pair of types (:class:`~trainer.config.BoundedStaleness`,
:class:`~trainer.config.FixedStaleness`: fields, defaults, ``mode``, ``versions``, validation,
parsed once at load); each strategy extends its settings type with the mechanism only (how groups
are admitted, batched and synced), so a strategy *is* its settings and adds no field.

* :class:`BoundedAdmission` (``{mode: bounded, max: s}``, as AReaL does): at most ``(s + 1)``
  training batches of prompt groups are admitted and not yet trained, so a group admitted at
  version ``v`` is normally trained at version ``≤ v + s``. At consumption the per-token
  staleness is checked again: a group whose oldest token is more than ``s`` versions old is
  dropped, counted in ``rollout/dropped_stale`` and its prompt re-queued. Weights are synced to
  the rollouts after every step. ``s = 0`` is synchronous on-policy training.
* :class:`FixedLag` (``{mode: fixed, lag: k}``): batch ``n`` is generated entirely by policy
  version ``max(n − k, 0)`` (kept in the state's :class:`~.lag.WeightHistory`; the rollouts are
  synced to it once the previous batch is fully generated, never inside a batch), so every token
  trained at step ``n ≥ k`` is exactly ``k`` versions old, independent of machine speed. Prompts
  whose episodes end by an infrastructure failure are replaced by new draws generated with the
  same version. ``k = 0`` is step for step the same as bounded mode with ``s = 0``.

Batches are ordered by prompt draw in both modes (reproducible, whatever the completion order).
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol

from ..config.train_section import BoundedStaleness, FixedStaleness, StalenessSettings
from ..errors import TrainingError
from .lag import generating_version
from .prompts import PromptStream
from .state import Group, LoopState

log = logging.getLogger(__name__)


class LoopServices(Protocol):
    """What a strategy may ask of the loop (:class:`~.loop.AsyncTrainingLoop` provides it)."""

    state: LoopState
    prompts: PromptStream
    learner: Any

    @property
    def prompts_per_step(self) -> int:
        """Prompt groups per training batch."""

    @property
    def total_steps(self) -> int:
        """Steps of the run."""

    def launch(self, uid: int) -> None:
        """Start the rollout of prompt draw ``uid`` (its group lands in ``state.ready``)."""

    async def sync(self, source: Any, version: int) -> None:
        """Make the rollouts generate with ``source.export_policy_weights()`` as ``version``."""

    async def snapshot(self, version: int) -> None:
        """Keep the learner's current weights as ``version`` in ``state.history``."""


def _stale_versions(g: Group) -> list[int]:
    return [v for t in g.trajs if (v := t.min_version()) is not None]


@dataclass(frozen=True)
class BoundedAdmission(BoundedStaleness):
    """Bounded staleness ``max`` (the settings: :class:`~trainer.config.BoundedStaleness`) by
    admission control, stale groups dropped at consumption.

    Raises:
        ValueError: ``max < 0``.
    """

    keeps_weights: ClassVar[bool] = False

    def may_admit(self, state: LoopState, prompts_per_step: int) -> bool:
        """Whether one more group may be admitted: ``len(in_flight) < (max + 1) × prompts_per_step``."""
        return len(state.in_flight) < (self.max + 1) * prompts_per_step

    def is_stale(self, group: Group, version: int) -> bool:
        """Whether ``group``'s oldest model token is more than ``max`` versions behind ``version``."""
        vs = _stale_versions(group)
        return bool(vs) and version - min(vs) > self.max

    async def start(self, loop: LoopServices) -> None:
        """Nothing to prepare (the rollouts start with the learner's weights)."""

    async def admit(self, loop: LoopServices) -> None:
        """Admit prompt groups while the bound allows and start their rollouts, until ``stop``."""
        st = loop.state
        while not st.stop:
            async with st.cond:
                await st.cond.wait_for(lambda: st.stop or self.may_admit(st, loop.prompts_per_step))
                if st.stop:
                    break
                uid = loop.prompts.next()
                st.in_flight.add(uid)
            loop.launch(uid)

    async def take_batch(self, loop: LoopServices) -> list[Group]:
        """The next ``prompts_per_step`` fresh groups (stale ones dropped and re-queued).

        Raises:
            TrainingError: a rollout task failed (``state.failure``), or the rollouts are stuck
                on old weights (:meth:`check_not_stuck`).
        """
        st, need = loop.state, loop.prompts_per_step
        async with st.cond:
            while True:
                await st.cond.wait_for(lambda: st.failure is not None or len(st.ready) >= need)
                if st.failure is not None:
                    raise st.failure
                stale = [g for g in st.ready if self.is_stale(g, st.version)]
                if stale:
                    st.counters["dropped_stale"] += len(stale)
                    st.dropped_since_step.extend(stale)
                    self.check_not_stuck(st, stale, need)
                    log.warning("dropping %d group(s) older than %d versions; prompts re-queued",
                                len(stale), self.max)
                    for g in stale:
                        st.in_flight.discard(g.uid)
                    loop.prompts.requeue([g.uid for g in stale])
                    st.cond.notify_all()
                st.ready = [g for g in st.ready if not self.is_stale(g, st.version)]
                if len(st.ready) >= need:
                    batch, st.ready = st.ready[:need], st.ready[need:]
                    return sorted(batch, key=lambda g: g.uid)

    def check_not_stuck(self, state: LoopState, stale: list[Group], prompts_per_step: int) -> None:
        """Fail instead of spinning when rollouts stay too stale without any step in between.

        Groups admitted after a drop are generated with the rollouts' current weights, so they
        can only be stale again if the rollouts do not get new weights: more than
        ``2 (max + 1) × prompts_per_step`` drops since the last step means they are stuck.

        Raises:
            TrainingError: the rollouts' policy version lags the learner's.
        """
        groups_since = len(state.dropped_since_step)
        if groups_since > 2 * (self.max + 1) * prompts_per_step:
            oldest = min(min(vs) for g in stale if (vs := _stale_versions(g)))
            raise TrainingError(
                f"{groups_since} groups dropped as stale since step {state.step} without any step: "
                f"rollouts come from policy version {oldest} while the learner is at {state.version} "
                f"(max staleness {self.max}); the rollout engine is not receiving weight updates")

    async def before_new_version(self, loop: LoopServices) -> None:
        """Nothing before the learner's version moves."""

    async def after_new_version(self, loop: LoopServices) -> None:
        """Sync the learner's new weights to the rollouts."""
        await loop.sync(loop.learner, loop.state.version)

    async def finish(self, loop: LoopServices) -> None:
        """Nothing: the rollouts already have the newest weights."""


@dataclass(frozen=True)
class FixedLag(FixedStaleness):
    """Exact staleness ``lag`` (the settings: :class:`~trainer.config.FixedStaleness`): batch ``n``
    generated by policy version ``max(n − lag, 0)``.

    ``groups_in_flight`` (``train.staleness.groups_in_flight``; 0: ``prompts_per_step``): most
    groups of one batch running or kept while it is short of kept groups (dynamic sampling); the
    batch is its first ``prompts_per_step`` kept groups in draw order once none of its groups runs,
    the rest surplus (counted, prompts re-queued).

    Raises:
        ValueError: ``lag < 0`` or ``groups_in_flight < 0``.
    """

    keeps_weights: ClassVar[bool] = True

    def generating_version(self, step: int) -> int:
        """The policy version that generates the batch trained at ``step``: ``max(step − lag, 0)``."""
        return generating_version(step, self.lag)

    def missing(self, state: LoopState, batch: int, prompts_per_step: int) -> tuple[int, int]:
        """``(groups to start now, groups running)`` for ``batch``: while it has fewer than
        ``prompts_per_step`` kept groups, enough to have ``max(groups_in_flight, prompts_per_step)``
        running or kept; none once it has them (to start ≤ 0: none)."""
        running = sum(b == batch for b in state.pending.values())
        ready = state.batch_ready.get(batch, 0)
        if ready >= prompts_per_step:
            return 0, running
        return max(self.groups_in_flight, prompts_per_step) - ready - running, running

    async def start(self, loop: LoopServices) -> None:
        """Keep the last ``lag + 1`` versions; keep the current one (not in a resumed history yet)."""
        st = loop.state
        st.history.lag = self.lag
        if st.version not in st.history:
            await loop.snapshot(st.version)

    async def _generating(self, loop: LoopServices, j: int) -> int | None:
        """Wait until batch ``j``'s version exists, sync the rollouts to it; None when stopping."""
        st = loop.state
        gen = self.generating_version(j)
        async with st.cond:
            await st.cond.wait_for(lambda: st.stop or st.version >= gen)
        if st.stop:
            return None
        if gen not in st.history:  # resumed from a checkpoint without the kept versions
            log.warning("policy version %d is not kept (kept: %s); batch %d uses the oldest kept one",
                        gen, st.history.versions(), j)
            gen = st.history.versions()[0]
        if st.engine_version != gen:  # the previous batch is fully generated here
            await loop.sync(st.history.get(gen), gen)
            st.engine_version = gen
        return gen

    async def admit(self, loop: LoopServices) -> None:
        """Generate batch after batch, batch ``j`` with policy version ``max(j − lag, 0)``; refill
        infrastructure failures until the batch is whole."""
        st, need, j = loop.state, loop.prompts_per_step, loop.state.step
        while not st.stop and j < loop.total_steps:
            gen = await self._generating(loop, j)
            if gen is None:
                break
            st.batch_version[j] = gen
            while not st.stop:
                async with st.cond:
                    missing, running = self.missing(st, j, need)
                    if st.batch_ready.get(j, 0) >= need and running == 0:
                        break
                    uids = [loop.prompts.next() for _ in range(max(missing, 0))]
                    for uid in uids:
                        st.in_flight.add(uid)
                        st.pending[uid] = j
                for uid in uids:
                    loop.launch(uid)
                async with st.cond:
                    await st.cond.wait()
            j += 1

    async def take_batch(self, loop: LoopServices) -> list[Group]:
        """The groups generated for this step, ordered by prompt draw, once all are there.

        Raises:
            TrainingError: a rollout task failed, or a group has tokens of another policy version
                than the batch's lagged one (the engine did not apply the weights it was sent).
        """
        st, need, step = loop.state, loop.prompts_per_step, loop.state.step
        async with st.cond:  # every group launched for the batch has finished (none still pending)
            await st.cond.wait_for(lambda: st.failure is not None or (
                st.batch_ready.get(step, 0) >= need and step not in st.pending.values()))
            if st.failure is not None:
                raise st.failure
            batch = sorted((g for g in st.ready if g.batch == step), key=lambda g: g.uid)
            st.ready = [g for g in st.ready if g.batch != step]
            batch, surplus = batch[:need], batch[need:]
            if surplus:  # groups_in_flight > prompts_per_step: kept groups beyond the batch
                uids = [g.uid for g in surplus]
                st.in_flight.difference_update(uids)
                loop.prompts.requeue(uids)
                st.counters["surplus_groups"] += len(surplus)
                st.surplus_since_step += len(surplus)
            for old in [b for b in st.batch_ready if b < step]:  # the producer is past them
                del st.batch_ready[old]
            want = st.batch_version.pop(step)
        got = {v for g in batch for t in g.trajs for v, m in zip(t.versions, t.loss_mask, strict=True) if m}
        if got - {want}:
            raise TrainingError(f"step {step + 1}: fixed lag {self.lag} generates with policy "
                                f"version {want} but the batch has tokens of versions {sorted(got)}")
        return batch

    async def before_new_version(self, loop: LoopServices) -> None:
        """Keep the learner's new weights for the producer, before the version moves (so a version
        the producer sees is always kept)."""
        await loop.snapshot(loop.state.version + 1)

    async def after_new_version(self, loop: LoopServices) -> None:
        """Nothing: the producer syncs the rollouts per batch."""

    async def finish(self, loop: LoopServices) -> None:
        """The rollouts end on the newest version."""
        st = loop.state
        if st.engine_version != st.version:
            await loop.sync(st.history.get(st.version), st.version)
            st.engine_version = st.version


#: A staleness strategy (what :class:`~.loop.LoopConfig` holds).
Staleness = BoundedAdmission | FixedLag


#: ``mode`` of the staleness settings → the strategy that extends its settings type.
STRATEGIES: dict[str, type[BoundedAdmission] | type[FixedLag]] = {
    BoundedAdmission.mode: BoundedAdmission, FixedLag.mode: FixedLag}


def staleness_strategy(settings: StalenessSettings) -> Staleness:
    """The strategy of effective staleness settings (:attr:`ExperimentConfig.staleness
    <trainer.config.ExperimentConfig.staleness>`: ``mode`` ``bounded`` with ``max``, or ``fixed``
    with ``lag``): the same fields, with the mechanism.

    Raises:
        ValueError: an unknown mode.
    """
    cls = STRATEGIES.get(settings.mode)
    if cls is None:
        raise ValueError(f"train.staleness.mode={settings.mode!r}: must be 'bounded' or 'fixed'")
    return cls(**{f.name: getattr(settings, f.name) for f in dataclasses.fields(settings)})
