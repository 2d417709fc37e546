"""Tokens the behaviour policy sampled outside the learner's top-k / top-p support.

With truncated sampling (:mod:`trainer.logprobs`) the learner's log-prob of a token µ sampled can be
``-inf``: under π's own logits the token is not in the top-k / nucleus (π moved since µ, or a
rounding flip at the nucleus edge). Its importance ratio π/µ is then exactly 0. The step keeps that
meaning without letting ``-inf`` reach any arithmetic (``-inf − (-inf)`` is NaN, ``0 · -inf`` too):

* :func:`floor_outside_support` replaces ``-inf`` at action tokens by :data:`OUTSIDE_SUPPORT_LOGP`,
  a finite log-prob whose ratio to any sampled token's µ is exactly 0 in float32 and float64
  (``exp(-1e4 − log µ) = 0``: a token with ``log µ < -745`` is never drawn), so estimators and
  ratio diagnostics see ρ = 0 (an advantage channel clips it to its lower bound);
* :func:`support_loss_mask` drops those tokens from the policy loss (they contribute 0; the
  mini-batch denominators are unchanged, as for tokens the policy channel masks);
* ``diag/outside_support_frac`` (:func:`outside_support_fraction`) counts them per step.
"""

from __future__ import annotations

import torch

Tensor = torch.Tensor

#: The finite stand-in for log π = -inf (a token outside π's support): exp(it − log µ) == 0.
OUTSIDE_SUPPORT_LOGP = -1.0e4


def floor_outside_support(logp: Tensor, loss_mask: Tensor) -> tuple[Tensor, Tensor]:
    """``(logp', outside)``: ``logp`` with ``-inf`` at action tokens replaced by
    :data:`OUTSIDE_SUPPORT_LOGP` (gradient 0 there), and the ``(B, T)`` bool mask of those tokens.

    Args:
        logp: ``(B, T)`` float32 log-probs (may carry grad). loss_mask: ``(B, T)`` 0/1 action tokens.

    Returns:
        ``logp`` itself (the same tensor, bit for bit) when no action token is ``-inf``; otherwise
        a new tensor. ``outside``: bool, False off the action tokens.
    """
    outside = torch.isneginf(logp) & loss_mask.bool()
    if not bool(outside.any()):
        return logp, outside
    return torch.where(outside, torch.full_like(logp, OUTSIDE_SUPPORT_LOGP), logp), outside


def is_outside(logp: Tensor) -> Tensor:
    """``(B, T)`` bool: entries at (or below) :data:`OUTSIDE_SUPPORT_LOGP`, i.e. floored by
    :func:`floor_outside_support`."""
    return logp <= OUTSIDE_SUPPORT_LOGP


def support_loss_mask(loss_mask: Tensor, *outside: Tensor) -> Tensor:
    """``loss_mask`` with the tokens of any ``outside`` mask set to 0 (same dtype); ``loss_mask``
    itself when none is set (the default path stays bit-identical)."""
    drop = torch.zeros_like(loss_mask, dtype=torch.bool)
    for o in outside:
        drop |= o
    if not bool(drop.any()):
        return loss_mask
    return loss_mask.masked_fill(drop, 0)


def outside_support_fraction(outside: Tensor, loss_mask: Tensor) -> float:
    """Fraction of the action tokens outside π's support (0.0 without action tokens)."""
    n = float(loss_mask.bool().sum())
    return float(outside.sum()) / n if n > 0 else 0.0
