"""A reward in a batch row with no action token raises, naming the row (issue 42 item 4.4).

The fold of observation rewards (copc/scan.py) refused a reward with no preceding action token in
its row, but :func:`copc.scan.td_residuals` returned before the fold whenever the (sub-)batch held
no action token at all: a one-row batch, or the rows that share a per-row λ (length-adaptive λ
gives a row with no action token λ = 0, so it is scanned alone) lost the reward silently.
"""

from __future__ import annotations

import pytest
import torch

import copc

NO_ACTION = r"rewards\[{row}, 2\] = 1\.0 is in row {row}, which has no action token; it cannot be attributed"


def _batch():
    rewards = torch.zeros(2, 4)
    rewards[0, 1], rewards[1, 2] = 0.5, 1.0  # row 1: a reward, no action token
    mask = torch.tensor([[1, 1, 0, 0], [0, 0, 0, 0]], dtype=torch.bool)
    return rewards, torch.zeros(2, 4), mask


def test_one_row_without_action_token_raises():
    rewards, values, mask = _batch()
    with pytest.raises(ValueError, match="^" + NO_ACTION.format(row=0)):
        copc.gae_advantage_return(rewards[1:], values[1:], mask[1:])


def test_whole_batch_raises_naming_the_row():
    rewards, values, mask = _batch()
    with pytest.raises(ValueError, match="^" + NO_ACTION.format(row=1)):
        copc.gae_advantage_return(rewards, values, mask)


def test_per_row_lambda_raises_naming_the_batch_row():
    # λ = 0.5 for row 0, 0.25 for row 1: row 1 is scanned alone (as row 0 of its subset)
    rewards, values, mask = _batch()
    with pytest.raises(ValueError, match="^" + NO_ACTION.format(row=0) + r" \(row indices within the rows "
                                         r"with lam = 0\.25: batch rows \[1\]\)$"):
        copc.gae_advantage_return(rewards, values, mask, lam=torch.tensor([0.5, 0.25]))
    logp = torch.zeros(2, 4)
    with pytest.raises(ValueError, match=NO_ACTION.format(row=0)):
        copc.coupled_advantage_return(rewards, values, logp, logp, mask, lam=torch.tensor([0.5, 0.9]))
    with pytest.raises(ValueError, match=NO_ACTION.format(row=0)):
        copc.vtrace_advantage_return(rewards[1:], values[1:], logp[1:], logp[1:], mask[1:])


def test_zero_reward_rows_without_action_tokens_are_zero():
    rewards, values, mask = _batch()
    rewards[1] = 0.0
    adv, ret = copc.gae_advantage_return(rewards, values, mask)
    assert adv.tolist() == [[0.5, 0.5, 0.0, 0.0], [0.0] * 4]  # γ = λ = 1: the reward at t = 1 reaches t = 0
    assert ret.tolist() == adv.tolist()  # V = 0
    assert copc.gae_advantage_return(rewards[1:], values[1:], mask[1:])[0].tolist() == [[0.0] * 4]
