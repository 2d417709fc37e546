"""Group-relative advantages of a group whose rewards are all equal are exactly 0 (issue 42 item 4.2).

In float32, 16 × 0.7 sums to a value whose mean is not exactly 0.7: each centred score was
±1.2e-7, the group's std ~1e-7, and ``centred / (std + 1e-6)`` gave 0.106 for every sequence
(0.056 for 0.35) — a learning signal from a group that carries none.
"""

from __future__ import annotations

import pytest
import torch

import copc


def _pre_fix(scores: torch.Tensor, group_ids: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """The formula of copc/outcome.py before the fix, verbatim: the reference for groups with
    distinct rewards, which must come out bit-identical."""
    _, inv, counts = torch.unique(group_ids, return_inverse=True, return_counts=True)
    n = counts.to(scores.dtype)
    mean = torch.zeros(counts.shape, dtype=scores.dtype).index_add_(0, inv, scores) / n
    centered = scores - mean[inv]
    sq = torch.zeros(counts.shape, dtype=scores.dtype).index_add_(0, inv, centered.square())
    std = torch.where(counts > 1, (sq / (n - 1).clamp(min=1)).sqrt(), torch.zeros_like(n))
    return centered / (std[inv] + eps)


@pytest.mark.parametrize("reward", [0.7, 0.35])
def test_equal_rewards_give_exactly_zero(reward):
    scores, groups = torch.full((16,), reward), torch.zeros(16, dtype=torch.long)
    assert _pre_fix(scores, groups).abs().min() > 0.05  # the artefact: 0.106 / 0.056, not 0
    assert torch.equal(copc.group_relative_advantages(scores, groups), torch.zeros(16))
    assert torch.equal(copc.group_relative_advantages(scores, groups, std_normalize=False), torch.zeros(16))
    assert torch.equal(copc.batch_normalized_advantages(scores), torch.zeros(16))  # SAO: one group
    s64 = scores.double()
    assert torch.equal(copc.group_relative_advantages(s64, groups), torch.zeros(16, dtype=torch.float64))


def test_mixed_batch_by_hand():
    # group 5: 16 × 0.7 -> 0; group 2: eight 1s and eight 0s: mean .5, unbiased std sqrt(16·.25/15)
    # = .5163978, advantage ±.5 / (.5163978 + 1e-6) = ±.9682440
    scores = torch.cat([torch.full((16,), 0.7), torch.tensor([1.0, 0.0] * 8)])
    groups = torch.tensor([5] * 16 + [2] * 16)
    adv = copc.group_relative_advantages(scores, groups)
    assert torch.equal(adv[:16], torch.zeros(16))
    torch.testing.assert_close(adv[16:], torch.tensor([0.9682440, -0.9682440] * 8), rtol=0, atol=1e-6)


def test_distinct_rewards_bit_identical_to_the_pre_fix_formula():
    g = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.float64):
        scores = torch.rand(96, generator=g, dtype=dtype)
        groups = torch.randint(0, 12, (96,), generator=g)
        assert torch.equal(copc.group_relative_advantages(scores, groups), _pre_fix(scores, groups))
        assert torch.equal(copc.batch_normalized_advantages(scores),
                           _pre_fix(scores, torch.zeros(96, dtype=torch.long)))
    # a batch holding constant groups: only those rows change (to 0)
    scores = torch.cat([torch.full((16,), 0.7), torch.rand(16, generator=g)])
    groups = torch.tensor([0] * 16 + [1] * 16)
    adv = copc.group_relative_advantages(scores, groups)
    assert torch.equal(adv[16:], _pre_fix(scores, groups)[16:])
