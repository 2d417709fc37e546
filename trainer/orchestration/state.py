"""The explicit state of a training loop: what the loop and its staleness strategy read and write.

:class:`LoopState` holds the resumable part (step, policy version, cumulative counters, per-version
reward tallies, kept policy versions of the fixed-lag mode) and the run-time bookkeeping (prompt
groups admitted, ready, pending; failure window; the condition producers and learner wait on).
Checkpoints hold :meth:`LoopState.checkpoint` output, the same dictionary layout as before the state
was a class (``prompts``, ``step``, ``version``, ``counters``, ``by_version``, ``weight_history`` in
fixed mode), so older checkpoints resume through :meth:`LoopState.resume`.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ..errors import TrainingError
from ..outputs.by_version import VersionTally
from ..rollout.trajectory import Trajectory
from .lag import WeightHistory
from .prompts import PromptStream

#: Cumulative counters of a run (continued across resumes through :meth:`LoopState.checkpoint`):
#: ``episodes`` (episodes finished, whatever became of them), ``episodes_trained``,
#: ``tokens_generated`` / ``tokens_trained`` (model tokens, i.e. loss-mask-1 tokens),
#: ``dropped_stale`` (groups dropped as too stale), ``infra_failed`` (episodes ended by an
#: infrastructure failure), ``infra_failed_groups`` (groups dropped for one), ``filtered_groups``
#: (groups dropped by dynamic sampling, :mod:`.group_filter`), ``surplus_groups`` (kept groups
#: beyond a fixed-lag batch's ``prompts_per_step``, ``train.staleness.groups_in_flight``).
COUNTERS = ("episodes", "episodes_trained", "tokens_generated", "tokens_trained", "dropped_stale",
            "infra_failed", "infra_failed_groups", "filtered_groups", "surplus_groups")
#: Metric name of each counter in ``metrics.jsonl`` (logged every step, cumulative).
COUNTER_METRICS = {"episodes": "rollout/episodes_total", "episodes_trained": "rollout/episodes_trained_total",
                   "tokens_generated": "rollout/tokens_generated_total",
                   "tokens_trained": "rollout/tokens_trained_total", "dropped_stale": "rollout/dropped_stale",
                   "infra_failed": "rollout/infra_failed",
                   "infra_failed_groups": "rollout/infra_failed_groups",
                   "filtered_groups": "rollout/filtered_groups",
                   "surplus_groups": "rollout/surplus_groups"}


@dataclass
class Group:
    """The episodes of one prompt draw ``uid``; ``batch`` is the step a fixed-lag group is generated
    for (-1 in bounded mode)."""

    uid: int
    trajs: list[Trajectory] = field(default_factory=list)
    batch: int = -1


@dataclass
class LoopState:
    """Everything a training loop knows about its progress.

    Attributes:
        step: training steps done.
        version: the learner's policy version (number of updates done; starts at ``step``).
        counters: the cumulative :data:`COUNTERS` (missing ones start at 0).
        history: the kept policy versions of the fixed-lag mode (empty when bounded).
        by_version: generating policy version → :class:`~trainer.outputs.by_version.VersionTally`
            of the episodes trained so far (cumulative over resumes, like ``counters``).
        in_flight: prompt draws admitted and not yet trained (running or ready).
        ready: finished groups not yet trained.
        pending: fixed lag: running prompt draw → the batch it is generated for.
        batch_ready / batch_version: fixed lag: batch → groups ready for it / the version
            generating it.
        engine_version: the policy version the rollout engine(s) generate with.
        infra_since_step: infrastructure-failed episodes since the last step.
        recent: infra-failed flags of the last step's worth of finished episodes (the stop rule's
            window; its ``maxlen`` is set by the loop).
        dropped_since_step: groups dropped as stale since the last step.
        filtered: batch → groups dynamic sampling dropped for it (fixed lag: the batch the group
            was generated for; bounded: -1, counted since the last step).
        filtered_since_step: groups dynamic sampling dropped since the last step.
        surplus_since_step: fixed lag: surplus kept groups left out of batches since the last step.
        failure: the first fatal error (the learner side raises it).
        stop: producers stop admitting.
        start_step: the step the run (re)started at.
        last_checkpoint_step: the last step a checkpoint was written for, or None.
        cond: the condition producers and the learner side wait on (guards all of the above).

    Raises:
        ValueError: unknown counter names.
    """

    step: int = 0
    counters: dict[str, int] = field(default_factory=dict)
    history: WeightHistory = field(default_factory=lambda: WeightHistory(0))
    by_version: dict[int, VersionTally] = field(default_factory=dict)
    in_flight: set[int] = field(default_factory=set)
    ready: list[Group] = field(default_factory=list)
    pending: dict[int, int] = field(default_factory=dict)
    batch_ready: dict[int, int] = field(default_factory=dict)
    batch_version: dict[int, int] = field(default_factory=dict)
    engine_version: int = -1
    infra_since_step: int = 0
    recent: deque[bool] = field(default_factory=deque)
    dropped_since_step: list[Group] = field(default_factory=list)
    filtered: dict[int, int] = field(default_factory=dict)
    filtered_since_step: int = 0
    surplus_since_step: int = 0
    failure: TrainingError | None = None
    stop: bool = False
    start_step: int = -1
    last_checkpoint_step: int | None = None
    cond: asyncio.Condition = field(default_factory=asyncio.Condition)
    version: int = field(init=False, default=0)

    def __post_init__(self) -> None:
        """Fill missing counters with 0, check the names; the run starts at ``step``."""
        unknown = set(self.counters) - set(COUNTERS)
        if unknown:
            raise ValueError(f"counters: unknown key(s) {sorted(unknown)}; known: {COUNTERS}")
        self.counters = {k: int(self.counters.get(k, 0)) for k in COUNTERS}
        self.version = self.step  # policy version = number of updates done
        if self.start_step < 0:
            self.start_step = self.step
        if self.engine_version < 0:
            self.engine_version = self.step  # the engine starts with the learner's weights

    @classmethod
    def resume(cls, saved: Mapping[str, Any] | None) -> LoopState:
        """The state of a checkpoint's ``loop`` entry (:meth:`checkpoint` output; None: a new run).

        Older checkpoints are read too: ``dropped_stale`` at the top level (before ``counters``),
        no ``weight_history`` (bounded mode, or fixed lag before kept versions were saved) and no
        ``by_version`` (the per-version tallies start empty).
        The prompt stream's part is restored by the caller into its :class:`PromptStream`.
        """
        if not saved:
            return cls()
        counters = dict(saved.get("counters", {}))
        counters.setdefault("dropped_stale", int(saved.get("dropped_stale", 0)))
        by_version = {int(v): VersionTally.from_list(t) for v, t in dict(saved.get("by_version", {})).items()}
        state = cls(step=int(saved["step"]), counters=counters, by_version=by_version)
        if saved.get("weight_history"):
            state.history.load_state_dict(dict(saved["weight_history"]))
        return state

    def checkpoint(self, prompts: PromptStream, keep_weights: bool) -> dict:
        """Resumable state: prompt stream (admitted-but-untrained prompts re-queued), step, version,
        the cumulative counters, the per-version tallies (``by_version``: version →
        ``[episodes, reward_sum, correct]``) and, when ``keep_weights`` (fixed lag), the kept policy
        versions."""
        state = {"prompts": prompts.state_dict(sorted(self.in_flight)), "step": self.step,
                 "version": self.version, "counters": dict(self.counters),
                 "by_version": {v: t.as_list() for v, t in sorted(self.by_version.items())}}
        if keep_weights:
            state["weight_history"] = self.history.state_dict()
        return state

    @property
    def dropped_stale(self) -> int:
        """Groups dropped as too stale so far (cumulative over resumes)."""
        return self.counters["dropped_stale"]

    @property
    def episodes_done(self) -> int:
        """Episodes finished so far (cumulative over resumes)."""
        return self.counters["episodes"]
