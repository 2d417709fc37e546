"""Critic-free, outcome-level advantages: group-relative (GRPO/DAPO) and batch-normalised (SAO).

These produce one advantage per sequence; :func:`broadcast_to_tokens` spreads it
over the action tokens of each sequence.
"""

from __future__ import annotations

import torch

from ._checks import as_bool_mask, check_1d

Tensor = torch.Tensor


def _check_scores(scores: Tensor) -> None:
    """Raise unless ``scores`` is a finite 1-D floating tensor."""
    if not isinstance(scores, torch.Tensor) or scores.dim() != 1:
        shape = tuple(scores.shape) if isinstance(scores, torch.Tensor) else type(scores).__name__
        raise ValueError(f"scores must be a 1-D (B,) tensor, got {shape}")
    check_1d("scores", scores, scores.shape[0])
    if not bool(torch.isfinite(scores).all()):
        i = int((~torch.isfinite(scores)).nonzero()[0])
        raise ValueError(f"scores[{i}] = {scores[i].item()!r} is not finite")


def group_relative_advantages(scores: Tensor, group_ids: Tensor, *, std_normalize: bool = True,
                              eps: float = 1e-6) -> Tensor:
    """GRPO / DAPO advantage ``(r − mean_g) / (std_g + eps)`` per sequence.

    Shao et al. 2024 (DeepSeekMath, §4.1.2, outcome supervision); DAPO (Yu et al. 2025)
    uses the same. ``std_g`` is the unbiased sample standard deviation of the group
    (``torch.std`` default, as in verl); a singleton group has std 0 and so
    advantage 0. A group whose scores are all equal (exactly: its min equals its max) gets
    exactly 0, as the formula says in exact arithmetic: in floating point its mean is not
    exactly the common score (16 × 0.7 in float32: ±1.2e-7), its std is ~1e-7, and
    ``centred / (std + eps)`` would give ±0.1 instead of 0. Groups with distinct scores are
    computed as before, bit for bit.

    Args:
        scores: ``(B,)`` float outcome reward per sequence.
        group_ids: ``(B,)`` integer id of each sequence's prompt group (any values).
        std_normalize: divide by ``std_g + eps`` (False: Dr. GRPO-style mean-centering only).
        eps: added to the std, > 0.

    Returns:
        ``(B,)`` tensor with ``scores.dtype``.

    Raises:
        ValueError: on shape mismatch, non-integer ``group_ids`` or NaN/inf scores.
    """
    _check_scores(scores)
    check_1d("group_ids", group_ids, scores.shape[0], floating=False)
    if group_ids.is_floating_point() or group_ids.dtype == torch.bool:
        raise ValueError(f"group_ids must be an integer tensor, got dtype {group_ids.dtype}")
    _, inv, counts = torch.unique(group_ids, return_inverse=True, return_counts=True)
    n = counts.to(scores.dtype)
    sums = torch.zeros(counts.shape, dtype=scores.dtype, device=scores.device).index_add_(0, inv, scores)
    mean = sums / n
    centered = scores - mean[inv]
    empty = torch.empty(counts.shape, dtype=scores.dtype, device=scores.device)
    constant = (empty.scatter_reduce(0, inv, scores, "amax", include_self=False)
                == empty.scatter_reduce(0, inv, scores, "amin", include_self=False))[inv]
    if not std_normalize:
        return torch.where(constant, 0.0, centered)
    sq = torch.zeros(counts.shape, dtype=scores.dtype, device=scores.device).index_add_(
        0, inv, centered.square())
    std = torch.where(counts > 1, (sq / (n - 1).clamp(min=1)).sqrt(), torch.zeros_like(n))
    return torch.where(constant, 0.0, centered / (std[inv] + eps))


def batch_normalized_advantages(scores: Tensor, *, eps: float = 1e-6) -> Tensor:
    """Batch-level advantage ``(r − mean_batch) / (std_batch + eps)`` (preset ``sao``).

    Spec "Baselines" (SAO, single rollout per prompt; **(choice)**: SAO's own paper was
    not available, this is the spec's definition). Unbiased std; a batch of one, or of equal
    scores, gives exactly 0 (:func:`group_relative_advantages` with one group).

    Args:
        scores: ``(B,)`` float outcome reward per sequence.
        eps: added to the std, > 0.

    Returns:
        ``(B,)`` tensor.

    Raises:
        ValueError: on a non-1-D input or NaN/inf scores.
    """
    _check_scores(scores)
    return group_relative_advantages(
        scores, torch.zeros(scores.shape[0], dtype=torch.long, device=scores.device), eps=eps)


def broadcast_to_tokens(seq_advantages: Tensor, loss_mask: Tensor) -> Tensor:
    """Spread a per-sequence value over that sequence's action tokens.

    Args:
        seq_advantages: ``(B,)`` float.
        loss_mask: ``(B, T)`` bool/0-1.

    Returns:
        ``(B, T)`` tensor: ``seq_advantages[b]`` on action tokens, 0 elsewhere.

    Raises:
        ValueError: on a batch-size mismatch.
    """
    m = as_bool_mask(loss_mask)
    check_1d("seq_advantages", seq_advantages, m.shape[0])
    return torch.where(m, seq_advantages[:, None], 0.0).to(seq_advantages.dtype)


def masked_whiten(values: Tensor, loss_mask: Tensor, *, eps: float = 1e-8) -> Tensor:
    """Whiten ``values`` over the action tokens of the batch: ``(x − mean) / (std + eps)``.

    Used when a config sets ``normalize_advantages`` (spec: off by default, **(choice)**).
    Biased std over action tokens; mask-0 positions come out 0.

    Args:
        values: ``(B, T)`` float.
        loss_mask: ``(B, T)`` bool/0-1.
        eps: > 0.

    Returns:
        ``(B, T)`` tensor.

    Raises:
        ValueError: if ``loss_mask`` is not a 0/1 tensor of the same shape.
    """
    m = as_bool_mask(loss_mask, values.shape)
    sel = values[m]
    if sel.numel() == 0:
        return torch.zeros_like(values)
    mean, std = sel.mean(), sel.std(unbiased=False)
    return torch.where(m, (values - mean) / (std + eps), 0.0)
