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
