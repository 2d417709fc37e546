"""Trajectory chokepoint and the padded batch handed to copc/."""

from __future__ import annotations

import math

import pytest
import torch

import copc
from trainer.rollout.batch import to_batch
from trainer.rollout.trajectory import NO_VERSION, Trajectory


def two_turn() -> Trajectory:
    tr = Trajectory(prompt_ids=[5, 6, 7], sample_id="a")
    tr.append_model_tokens([10, 11], [-0.5, -1.0], 3)
    tr.append_observation_tokens([20, 21, 22])
    tr.append_model_tokens([12], [-0.25], [4])
    tr.reward = 1.0
    return tr


def test_trajectory_stays_aligned():
    tr = two_turn()
    assert tr.response_ids == [10, 11, 20, 21, 22, 12]
    assert tr.loss_mask == [1, 1, 0, 0, 0, 1]
    assert tr.logp_mu == [-0.5, -1.0, 0.0, 0.0, 0.0, -0.25]
    assert tr.versions == [3, 3, NO_VERSION, NO_VERSION, NO_VERSION, 4]
    assert tr.num_model_tokens == 3 and tr.turns == 2 and tr.min_version() == 3
    assert tr.model_token_ids() == [10, 11, 12]


def test_chokepoint_rejects_bad_appends():
    tr = Trajectory(prompt_ids=[1])
    with pytest.raises(ValueError, match="observation tokens have no behavior log-probs"):
        tr.append_observation_tokens([1, 2], logprobs=[-0.1, -0.2])
    with pytest.raises(ValueError, match="2 token ids but 1 logprobs"):
        tr.append_model_tokens([1, 2], [-0.1], 0)
    with pytest.raises(ValueError, match=r"logprobs\[1\] = nan"):
        tr.append_model_tokens([1, 2], [-0.1, math.nan], 0)
    with pytest.raises(ValueError, match="must be finite and <= 0"):
        tr.append_model_tokens([1], [0.5], 0)
    assert tr.response_ids == [] and tr.loss_mask == []  # nothing half-appended


def test_to_batch_layout_and_copc_roundtrip():
    a = two_turn()
    b = Trajectory(prompt_ids=[9], sample_id="b", group_id="a")
    b.append_model_tokens([13], [-2.0], 4)
    b.reward = -1.0
    batch = to_batch([a, b], pad_token_id=0)
    P, T = batch.prompt_len, batch.loss_mask.shape[1]
    assert (P, T) == (3, 6)
    assert batch.input_ids.tolist() == [[5, 6, 7, 10, 11, 20, 21, 22, 12], [0, 0, 9, 13, 0, 0, 0, 0, 0]]
    assert batch.attention_mask.tolist() == [[1] * 9, [0, 0, 1, 1, 0, 0, 0, 0, 0]]
    assert batch.position_ids[1, 2:4].tolist() == [0, 1] and batch.position_ids[0, -1] == 8
    assert batch.loss_mask.tolist() == [[1, 1, 0, 0, 0, 1], [1, 0, 0, 0, 0, 0]]
    assert batch.rewards.tolist() == [[0, 0, 0, 0, 0, 1.0], [-1.0, 0, 0, 0, 0, 0]]
    assert batch.versions[0].tolist() == [3, 3, -1, -1, -1, 4]
    assert batch.group_ids.tolist() == [0, 0] and batch.scores.tolist() == [1.0, -1.0]
    assert batch.response_ids[0].tolist() == a.response_ids
    # the batch feeds copc directly: GAE returns at γ=λ=1 are the outcome reward
    _, ret = copc.gae_advantage_return(batch.rewards, torch.zeros(2, T), batch.loss_mask)
    assert ret.tolist() == [[1, 1, 0, 0, 0, 1], [-1, 0, 0, 0, 0, 0]]
    sub = batch.select([1])
    assert sub.sample_ids == ["b"] and sub.input_ids.shape == (1, 9)


def test_to_batch_refuses_unattributable_reward():
    tr = Trajectory(prompt_ids=[1], reward=1.0)
    with pytest.raises(ValueError, match="no model token"):
        to_batch([tr], 0)
    with pytest.raises(ValueError, match="no trajectories"):
        to_batch([], 0)


def three_turn_with_step_rewards() -> Trajectory:
    """Turn 1 (2 tokens) → step reward 0.5, obs (2) → turn 2 (1 token) → step reward 0,
    obs (1) → turn 3 (2 tokens) → terminal reward 1.0."""
    tr = Trajectory(prompt_ids=[1, 2], sample_id="s")
    tr.append_model_tokens([10, 11], [-0.1, -0.2], 0)
    tr.add_reward(0.5)
    tr.append_observation_tokens([20, 21])
    tr.append_model_tokens([12], [-0.3], 0)
    tr.add_reward(0.0)
    tr.append_observation_tokens([22])
    tr.append_model_tokens([13, 14], [-0.4, -0.5], 1)
    tr.add_reward(1.0)
    return tr


def test_add_reward_places_each_step_on_its_turns_last_model_token():
    tr = three_turn_with_step_rewards()
    assert tr.loss_mask == [1, 1, 0, 0, 1, 0, 1, 1]
    assert tr.step_rewards == [(1, 0.5), (4, 0.0), (7, 1.0)]
    assert tr.reward == 1.5  # the episode return
    assert tr.token_rewards() == {1: 0.5, 7: 1.0}
    # a reward recorded after an observation was appended still goes on the preceding
    # action token (the fold rule), never on the observation
    late = Trajectory(prompt_ids=[1])
    late.append_model_tokens([10], [-0.1], 0)
    late.append_observation_tokens([20, 21])
    late.add_reward(-2.0)
    assert late.step_rewards == [(0, -2.0)] and late.token_rewards() == {0: -2.0}


def test_to_batch_multi_step_rewards_and_scores():
    a = three_turn_with_step_rewards()
    b = Trajectory(prompt_ids=[3], sample_id="t")  # one turn, terminal reward only
    b.append_model_tokens([15, 16, 17], [-0.1, -0.1, -0.1], 2)
    b.add_reward(-1.0)
    c = Trajectory(prompt_ids=[4], sample_id="u")  # legacy: reward assigned directly
    c.append_model_tokens([18], [-0.1], 2)
    c.append_observation_tokens([23])
    c.append_model_tokens([19], [-0.1], 2)
    c.reward = 2.0
    batch = to_batch([a, b, c], pad_token_id=0)
    assert batch.rewards.dtype == torch.float32 and batch.rewards.shape == (3, 8)
    assert batch.rewards.tolist() == [[0, 0.5, 0, 0, 0, 0, 0, 1.0],
                                      [0, 0, -1.0, 0, 0, 0, 0, 0],
                                      [0, 0, 2.0, 0, 0, 0, 0, 0]]
    assert batch.scores.dtype == torch.float32 and batch.scores.tolist() == [1.5, -1.0, 2.0]
    assert torch.equal(batch.rewards.sum(1), batch.scores)
    assert not bool((batch.rewards * (1 - batch.loss_mask)).any())  # never on obs/padding
    # copc accepts it even when refusing observation rewards; GAE returns at γ=λ=1, V=0 are
    # the reward-to-go: 1.5 on turn 1, 1.0 on turns 2 and 3
    _, ret = copc.gae_advantage_return(batch.rewards, torch.zeros(3, 8), batch.loss_mask,
                                       obs_reward="error")
    assert ret[0].tolist() == [1.5, 1.5, 0, 0, 1.0, 0, 1.0, 1.0]


def test_step_rewards_with_a_direct_reward_and_a_cleared_trajectory():
    tr = three_turn_with_step_rewards()
    tr.reward = 2.5  # the return was raised by hand: the unaccounted 1.0 is an outcome reward
    assert tr.token_rewards() == {1: 0.5, 7: 2.0}
    tr.clear_rewards()
    assert tr.reward == 0.0 and tr.step_rewards == [] and tr.token_rewards() == {}
    assert not bool(to_batch([tr], 0).rewards.any())
    # float sums are exact: the remainder of rewards that all went through add_reward is 0
    f = Trajectory(prompt_ids=[1])
    f.append_model_tokens([10], [-0.1], 0)
    for r in (0.1, 0.2, 0.3):
        f.add_reward(r)
    assert f.token_rewards() == {0: 0.1 + 0.2 + 0.3} and f.reward == 0.1 + 0.2 + 0.3


def test_add_reward_and_to_batch_refuse_bad_rewards():
    tr = Trajectory(prompt_ids=[1], sample_id="x")
    tr.add_reward(0.0)  # a zero reward needs no model token
    with pytest.raises(ValueError, match="no model token"):
        tr.add_reward(1.0)
    tr.append_model_tokens([10], [-0.1], 0)
    with pytest.raises(ValueError, match="not finite"):
        tr.add_reward(math.nan)
    with pytest.raises(ValueError, match="not finite"):
        tr.add_reward(math.inf)
    with pytest.raises(TypeError):
        tr.add_reward(None)
    assert tr.step_rewards == [(-1, 0.0)] and tr.reward == 0.0  # nothing half-recorded
    # a hand-built step reward on an observation token (or out of range) cannot be placed
    bad = Trajectory(prompt_ids=[1], sample_id="y", step_rewards=[(1, 0.5)], reward=0.5)
    bad.append_model_tokens([10], [-0.1], 0)
    bad.append_observation_tokens([20])
    with pytest.raises(ValueError, match=r"trajectory 0: step reward 0.5 at response index 1 "
                                         r"of sample 'y': not a model token"):
        to_batch([bad], 0)
