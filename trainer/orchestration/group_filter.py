"""Dynamic sampling (``train.filter_groups``): drop prompt groups whose episodes all got one reward.

DAPO's "dynamic sampling" (Yu et al. 2025, arXiv:2503.14476, §3.2; verl's
``algorithm.filter_groups``): a group of ``n ≥ 2`` episodes of one prompt whose rewards are all
equal (every episode wrong, or every one right) carries no contrast between the policy's own
samples; dropping it and drawing another prompt in its place fills the batch with groups that
do. With a sparse reward this multiplies the rewarded episodes per trained batch, at the cost of
more generation, which pays when the learner, not the rollout engine, is the bottleneck.

A dropped group is counted (``rollout/filtered_groups``, cumulative, and
``rollout/filtered_groups_step``), its prompt is consumed (not re-queued, as in DAPO), and the
staleness strategy draws a replacement exactly as for an infrastructure failure (fixed lag: with
the same lagged policy version). So that a policy that never earns a reward cannot stall a run,
at most ``max_per_batch`` groups are dropped for one batch; after that the batch takes its groups
whatever their rewards (logged once per batch).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ..rollout.trajectory import Trajectory


def reward_spread(trajs: Sequence[Trajectory]) -> float:
    """``max − min`` of the episodes' returns (:attr:`Trajectory.reward`); 0.0 for no episode."""
    rewards = [float(t.reward) for t in trajs]
    return max(rewards) - min(rewards) if rewards else 0.0


@dataclass(frozen=True)
class GroupFilter:
    """Which finished groups dynamic sampling drops.

    Attributes:
        max_per_batch: groups dropped for one batch before the batch keeps groups whatever their
            rewards (``>= 0``; 0: nothing is ever dropped).

    Raises:
        ValueError: a negative or non-int ``max_per_batch``.
    """

    max_per_batch: int

    def __post_init__(self) -> None:
        """Validate the cap."""
        if isinstance(self.max_per_batch, bool) or not isinstance(self.max_per_batch, int) \
                or self.max_per_batch < 0:
            raise ValueError(f"GroupFilter.max_per_batch={self.max_per_batch!r}: must be an int >= 0")

    def drops(self, trajs: Sequence[Trajectory], dropped_for_batch: int) -> bool:
        """Whether to drop this group: all its episodes have the same return and fewer than
        ``max_per_batch`` groups were dropped for its batch so far (``dropped_for_batch``).

        A group of one episode has no spread and would always be dropped: the config refuses
        ``train.filter_groups`` with ``rollout.n_samples_per_prompt < 2``.
        """
        return dropped_for_batch < self.max_per_batch and reward_spread(trajs) == 0.0
