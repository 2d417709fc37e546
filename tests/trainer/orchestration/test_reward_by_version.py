"""Reward and accuracy by generating policy version: per step, cumulative over steps in the loop
state, and kept by a checkpoint (hand-computed on real Trajectory objects)."""

from __future__ import annotations

import pytest

from trainer.orchestration.prompts import PromptStream
from trainer.orchestration.state import LoopState
from trainer.orchestration.step_metrics import by_version_metrics, generating_version, tally_by_version
from trainer.outputs.by_version import VersionTally
from trainer.rollout.trajectory import Trajectory

from .test_staleness_split import _traj  # an episode of model turns with given per-token versions


def test_a_step_of_versions_0_0_1_with_rewards_1_0_1():
    trajs = [_traj([[0, 0]], 1.0), _traj([[0]], 0.0), _traj([[1, 1, 1]], 1.0)]
    totals: dict[int, VersionTally] = {}
    m = by_version_metrics(trajs, totals)
    assert m["rollout/reward_by_version/v0"] == 0.5 and m["rollout/reward_by_version/v1"] == 1.0
    assert m["rollout/episodes_by_version/v0"] == 2.0 and m["rollout/episodes_by_version/v1"] == 1.0
    assert m["rollout/accuracy_by_version/v0"] == 0.5 and m["rollout/accuracy_by_version/v1"] == 1.0
    # the first step's totals are the step's own figures
    assert m["rollout/reward_by_version_total/v0"] == 0.5 and m["rollout/episodes_by_version_total/v1"] == 1.0
    assert totals == {0: VersionTally(2, 1.0, 1.0), 1: VersionTally(1, 1.0, 1.0)}


def test_totals_pool_over_steps_weighted_by_episode_counts():
    totals: dict[int, VersionTally] = {}
    by_version_metrics([_traj([[0]], 1.0), _traj([[0]], 0.0), _traj([[1]], 1.0)], totals)
    # step 2: one late v0 episode (reward 1) and three v1 ones (rewards 0, 0, 0.4)
    m = by_version_metrics([_traj([[0]], 1.0)] + [_traj([[1]], r) for r in (0.0, 0.0, 0.4)], totals)
    assert m["rollout/reward_by_version/v0"] == 1.0 and m["rollout/episodes_by_version/v1"] == 3.0
    assert m["rollout/reward_by_version/v1"] == pytest.approx(0.4 / 3)
    # v0: rewards 1, 0, 1 → 2/3 (not the mean of the steps' means, 0.75); v1: 1, 0, 0, 0.4 → 0.35
    assert m["rollout/reward_by_version_total/v0"] == pytest.approx(2 / 3)
    assert m["rollout/episodes_by_version_total/v0"] == 3.0
    assert m["rollout/reward_by_version_total/v1"] == pytest.approx(0.35)
    assert m["rollout/accuracy_by_version_total/v1"] == 0.25  # only the reward-1 episode is > 0.5
    # a step without v0 episodes logs no v0 key, per step or total
    m3 = by_version_metrics([_traj([[2]], 0.0)], totals)
    assert sorted(m3) == ["rollout/accuracy_by_version/v2", "rollout/accuracy_by_version_total/v2",
                          "rollout/episodes_by_version/v2", "rollout/episodes_by_version_total/v2",
                          "rollout/reward_by_version/v2", "rollout/reward_by_version_total/v2"]
    assert totals[0].episodes == 3 and totals[2].episodes == 1


def test_generating_version_is_the_first_model_turns():
    # bounded mode: the policy changed between the two turns; the episode counts for version 3
    multi = _traj([[3, 3], [4]], 1.0)
    assert generating_version(multi) == 3
    empty = Trajectory(prompt_ids=[1])
    empty.append_observation_tokens([5])
    assert generating_version(empty) is None
    assert tally_by_version([multi, empty]) == {3: VersionTally(1, 1.0, 1.0)}  # no model token: left out


def test_checkpoint_and_resume_keep_the_tallies():
    state = LoopState(step=4)
    state.by_version = {0: VersionTally(3, 2.0, 2.0), 2: VersionTally(1, 0.25, 0.0)}
    saved = state.checkpoint(PromptStream([{"id": 1}], 0), keep_weights=False)
    assert saved["by_version"] == {0: [3.0, 2.0, 2.0], 2: [1.0, 0.25, 0.0]}
    resumed = LoopState.resume(saved)
    assert resumed.by_version == state.by_version and resumed.step == 4
    by_version_metrics([_traj([[2]], 1.0)], resumed.by_version)
    assert resumed.by_version[2] == VersionTally(2, 1.25, 1.0)  # continues, not restarted
    old = {k: v for k, v in saved.items() if k != "by_version"}  # a checkpoint from before the tallies
    assert LoopState.resume(old).by_version == {}
