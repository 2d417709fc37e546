"""Loss aggregation over action tokens, exact across micro-batches (spec, "Policy channel").

Modes (names as in verl):

* ``token-mean``: ``Σ_{b,t} m·ℓ / N_tokens`` — every action token in the batch weighs the same.
* ``seq-mean-token-mean``: ``(1/N_seq) Σ_b (1/|y_b|) Σ_t m·ℓ`` — the COPC paper's
  per-sequence ``1/|y|`` then mean over sequences (default).
* ``seq-mean-token-sum``: ``(1/N_seq) Σ_b Σ_t m·ℓ``.

``N_tokens`` and ``N_seq`` default to the counts in the given batch. When a
batch is split into micro-batches for gradient accumulation, pass the counts
of the *whole* batch (from :func:`batch_denominators`) and the micro-batch
losses sum exactly to the full-batch loss. Rows with no action token add 0
and do not count in ``N_seq``; a batch with no action token gives a loss of 0
that still carries a (zero) gradient.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ._checks import as_bool_mask, check_2d_float
from ._scalars import LOSS_AGG_MODES  # defined without torch (config validation reads it)

Tensor = torch.Tensor


def check_loss_agg_mode(mode: str) -> None:
    """Raise ``ValueError`` naming ``loss_agg_mode`` unless it is one of :data:`LOSS_AGG_MODES`."""
    if mode not in LOSS_AGG_MODES:
        raise ValueError(f"loss_agg_mode must be one of {LOSS_AGG_MODES}, got {mode!r}")


@dataclass(frozen=True)
class Denominators:
    """Global normalisers of one optimizer mini-batch.

    Attributes:
        num_tokens: number of action tokens in the mini-batch (``N_tokens``).
        num_sequences: number of sequences with at least one action token (``N_seq``).
    """

    num_tokens: int
    num_sequences: int


def batch_denominators(loss_mask: Tensor) -> Denominators:
    """Count action tokens and non-empty sequences of a ``(B, T)`` loss mask.

    Args:
        loss_mask: ``(B, T)`` bool/0-1 of the whole mini-batch (before splitting).

    Returns:
        :class:`Denominators` (plain ints).

    Raises:
        ValueError: if ``loss_mask`` is not 2-D 0/1.
    """
    m = as_bool_mask(loss_mask)
    per_seq = m.sum(1)
    return Denominators(int(per_seq.sum()), int((per_seq > 0).sum()))


def aggregate_loss(token_losses: Tensor, loss_mask: Tensor, loss_agg_mode: str = "seq-mean-token-mean",
                   denominators: Denominators | None = None) -> Tensor:
    """Reduce per-token losses to a scalar over action tokens (modes: see module docstring;
    ``seq-mean-token-mean`` is the COPC paper's ``mean_seq (1/|y|) Σ_t``, spec "Policy channel").

    Args:
        token_losses: ``(B, T)`` float per-token loss; positions with ``loss_mask == 0`` are
            ignored, whatever they hold (NaN included), and receive zero gradient.
        loss_mask: ``(B, T)`` bool/0-1, 1 on action tokens.
        loss_agg_mode: one of :data:`LOSS_AGG_MODES`.
        denominators: global counts for micro-batching (default: this batch's own).

    Returns:
        0-dim tensor with ``token_losses.dtype``.

    Raises:
        ValueError: on a bad mode, mismatched shapes or a non 0/1 mask.
    """
    check_loss_agg_mode(loss_agg_mode)
    check_2d_float("token_losses", token_losses)
    m = as_bool_mask(loss_mask, token_losses.shape)
    masked = torch.where(m, token_losses, 0.0)
    den = batch_denominators(m) if denominators is None else denominators
    if loss_agg_mode == "token-mean":
        return masked.sum() / max(den.num_tokens, 1)
    per_seq = masked.sum(1)
    if loss_agg_mode == "seq-mean-token-mean":
        n_tok = m.sum(1).clamp(min=1).to(token_losses.dtype)
        per_seq = per_seq / n_tok
    return per_seq.sum() / max(den.num_sequences, 1)
