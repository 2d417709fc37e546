"""Loss aggregation (exact across micro-batches) and the clipped value loss."""

from __future__ import annotations

import pytest
import torch

import copc

F64 = torch.float64


@pytest.mark.parametrize("mode", copc.LOSS_AGG_MODES)
def test_micro_batches_sum_to_full_batch_loss_and_gradient(mode):
    g = torch.Generator().manual_seed(0)
    B, T = 10, 17
    mask = torch.rand(B, T, generator=g) < 0.6
    mask[3] = False  # an empty row is allowed and ignored
    base = torch.randn(B, T, generator=g, dtype=F64)
    full_x = base.clone().requires_grad_(True)
    full = copc.aggregate_loss(full_x.square(), mask, mode)
    full.backward()
    den = copc.batch_denominators(mask)
    mb_x = base.clone().requires_grad_(True)
    total = sum(copc.aggregate_loss(mb_x[s].square(), mask[s], mode, den)
                for s in (slice(0, 3), slice(3, 4), slice(4, 10)))
    total.backward()
    torch.testing.assert_close(total, full, atol=1e-12, rtol=0)
    torch.testing.assert_close(mb_x.grad, full_x.grad, atol=1e-12, rtol=0)


def test_aggregation_modes_hand_computed():
    loss = torch.tensor([[1.0, 2.0, 3.0, 99.0], [4.0, 0.0, 0.0, float("nan")]], dtype=F64)
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0]], dtype=torch.bool)
    assert copc.aggregate_loss(loss, mask, "token-mean").item() == pytest.approx(10 / 4)
    assert copc.aggregate_loss(loss, mask, "seq-mean-token-mean").item() == pytest.approx((2 + 4) / 2)
    assert copc.aggregate_loss(loss, mask, "seq-mean-token-sum").item() == pytest.approx((6 + 4) / 2)
    assert copc.batch_denominators(mask) == copc.Denominators(num_tokens=4, num_sequences=2)


def test_empty_batch_gives_zero_loss_with_gradient():
    x = torch.randn(2, 3, dtype=F64, requires_grad=True)
    loss = copc.aggregate_loss(x, torch.zeros(2, 3, dtype=torch.bool), "seq-mean-token-mean")
    loss.backward()
    assert loss.item() == 0.0 and (x.grad == 0).all()


def test_value_loss_hand_computed():
    values = torch.tensor([[1.0, 0.2, 5.0]], dtype=F64, requires_grad=True)
    values_old = torch.tensor([[0.0, 0.0, float("nan")]], dtype=F64)
    returns = torch.tensor([[2.0, 0.0, 1.0]], dtype=F64)
    mask = torch.tensor([[1, 1, 0]], dtype=torch.bool)
    loss, m = copc.value_loss(values, values_old, returns, mask, clip_eps=0.5)
    # token 0: max((1-2)^2, (0.5-2)^2) = 2.25 → 1.125; token 1: 0.04 → 0.02
    assert loss.item() == pytest.approx((1.125 + 0.02) / 2)
    assert m["critic/vf_clipfrac"] == pytest.approx(0.5)
    loss.backward()
    # token 0's clipped branch is active: its gradient is 0 (V_clip does not move with V)
    assert values.grad[0, 0].item() == 0.0
    assert values.grad[0, 1].item() == pytest.approx(0.2 / 2)
    unclipped, _ = copc.value_loss(values, values_old, returns, mask, clip_eps=None)
    assert unclipped.item() == pytest.approx((0.5 + 0.02) / 2)


def test_value_loss_errors():
    v = torch.zeros(1, 2, dtype=F64)
    mask = torch.ones(1, 2, dtype=torch.bool)
    with pytest.raises(ValueError, match="clip_eps must be > 0"):
        copc.value_loss(v, v, v, mask, clip_eps=0.0)
    with pytest.raises(ValueError, match=r"returns\[0, 1\] = nan"):
        copc.value_loss(v, v, torch.tensor([[0.0, float("nan")]], dtype=F64), mask)
