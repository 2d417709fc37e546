"""Staleness split into in-flight and in-queue parts, and the trained vs dropped length / reward
distributions of a step (hand-computed on real Trajectory objects)."""

from __future__ import annotations

import pytest

from trainer.orchestration.step_metrics import (
    dropped_metrics,
    length_reward_distribution,
    rollout_metrics,
    staleness_split_metrics,
)
from trainer.rollout.trajectory import Trajectory


def _traj(turns: list[list[int]], reward: float = 0.0) -> Trajectory:
    """An episode whose model turns have these per-token versions (an observation between turns)."""
    tr = Trajectory(prompt_ids=[1, 2])
    for i, vs in enumerate(turns):
        if i:
            tr.append_observation_tokens([7, 7])
        tr.append_model_tokens(list(range(3, 3 + len(vs))), [-0.5] * len(vs), vs)
    tr.reward = reward
    return tr


def test_in_flight_and_in_queue_hand_computed():
    # trained at version 5. A: tokens from v2, v2 | obs | v4 → v_last 4: flight [2, 2, 0], queue 1.
    # B: tokens v5, v5 → flight [0, 0], queue 0.
    a, b = _traj([[2, 2], [4]]), _traj([[5, 5]])
    m = staleness_split_metrics([a, b], 5)
    assert m == {"staleness/in_flight_mean": (2 + 0) / 2, "staleness/in_flight_max": 2.0,
                 "staleness/in_flight_token_mean": (2 + 2 + 0 + 0 + 0) / 5,
                 "staleness/in_queue_mean": (1 + 0) / 2, "staleness/in_queue_max": 1.0,
                 "staleness/in_queue_token_mean": (1 + 1 + 1 + 0 + 0) / 5}
    # the two parts add up to each token's staleness: token means add up to the staleness mean
    per_token = rollout_metrics([a, b], 6)["staleness/per_token"]
    assert per_token == [3, 3, 1, 0, 0]
    assert m["staleness/in_flight_token_mean"] + m["staleness/in_queue_token_mean"] == pytest.approx(
        sum(per_token) / len(per_token))


def test_rollout_metrics_carry_the_split_and_the_trained_distribution():
    trajs = [_traj([[0] * n], reward=r) for n, r in ((1, 0.0), (2, 1.0), (3, 1.0), (10, 0.0))]
    m = rollout_metrics(trajs, 2)
    assert m["staleness/in_queue_mean"] == 1.0 and m["staleness/in_flight_max"] == 0.0
    # nearest rank of lengths [1, 2, 3, 10]: p50 → the ⌈2⌉nd = 2; p90 → the ⌈3.6⌉th = 10
    assert (m["rollout/trained_len_p50"], m["rollout/trained_len_p90"]) == (2.0, 10.0)
    assert (m["rollout/trained_reward_p50"], m["rollout/trained_reward_p90"]) == (0.0, 1.0)


def test_dropped_metrics_give_count_and_quantiles_beside_the_means():
    dropped = [_traj([[0] * 4], 1.0), _traj([[0] * 8], 0.0)]
    m = dropped_metrics(dropped)
    assert m["rollout/dropped_stale_episodes"] == 2.0 and m["rollout/dropped_stale_len"] == 6.0
    assert (m["rollout/dropped_stale_len_p50"], m["rollout/dropped_stale_len_p90"]) == (4.0, 8.0)
    assert dropped_metrics([]) == {} and length_reward_distribution([], "x") == {}


def test_episodes_without_model_tokens_are_left_out():
    empty = Trajectory(prompt_ids=[1])
    assert staleness_split_metrics([empty], 3) == {}
    assert staleness_split_metrics([empty, _traj([[1]])], 3)["staleness/in_queue_mean"] == 2.0
