"""The one definition of a token's log-prob, shared by rollout engines and the learner.

Convention (used everywhere in COPC): the behavior log-prob of a sampled token is
``log softmax(logits / temperature)[token]`` computed in float32 from the model's
*raw* logits, **before** top-p / top-k truncation and without any other logits
processor. The learner recomputes ``logp_old`` / ``logp`` with the same function
and the same temperature, so ratios compare like with like. (Processed scores, e.g.
after ``min_new_tokens`` or top-p renormalisation, are not what the learner can
recompute: they differ by ~5e-3 and more.)
"""

from __future__ import annotations

import torch

Tensor = torch.Tensor


def token_logprobs(logits: Tensor, token_ids: Tensor, temperature: float = 1.0) -> Tensor:
    """Log-prob of each token under ``softmax(logits / temperature)``.

    Args:
        logits: ``(..., V)`` raw logits (any float dtype) of the position *before* each token.
        token_ids: ``(...)`` int64 ids, same leading shape as ``logits``.
        temperature: > 0 (the sampling temperature of the rollout).

    Returns:
        ``(...)`` float32 log-probs (natural log); differentiable w.r.t. ``logits``.

    Raises:
        ValueError: if ``temperature <= 0`` or the shapes do not line up.
    """
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature!r}")
    if logits.shape[:-1] != token_ids.shape:
        raise ValueError(f"logits {tuple(logits.shape)} and token_ids {tuple(token_ids.shape)} "
                         "must share leading dimensions")
    scaled = logits.float()
    if temperature != 1.0:
        scaled = scaled / temperature
    logz = torch.logsumexp(scaled, dim=-1)
    picked = scaled.gather(-1, token_ids.unsqueeze(-1)).squeeze(-1)
    return picked - logz


def sequence_logprobs(model: torch.nn.Module, input_ids: Tensor, attention_mask: Tensor,
                      temperature: float = 1.0, position_ids: Tensor | None = None) -> Tensor:
    """Per-token log-probs of a causal LM over whole sequences (learner side).

    Token ``i`` is scored by the logits at position ``i − 1`` (explicit alignment, no
    hidden roll): ``out[:, i] = log p(input_ids[:, i] | input_ids[:, :i])`` for
    ``i ≥ 1``; ``out[:, 0] = 0``.

    Args:
        model: a ``transformers`` causal LM returning ``.logits`` ``(B, L, V)``.
        input_ids: ``(B, L)`` int64 (left or right padded).
        attention_mask: ``(B, L)`` 0/1.
        temperature: the rollout temperature.
        position_ids: ``(B, L)`` int64; default ``cumsum(attention_mask) − 1`` (handles left padding).

    Returns:
        ``(B, L)`` float32 (0 at position 0; arbitrary at padding positions).
    """
    if position_ids is None:
        position_ids = (attention_mask.long().cumsum(1) - 1).clamp(min=0)
    logits = model(input_ids=input_ids, attention_mask=attention_mask,
                   position_ids=position_ids).logits
    out = torch.zeros(input_ids.shape, dtype=torch.float32, device=input_ids.device)
    out[:, 1:] = token_logprobs(logits[:, :-1], input_ids[:, 1:], temperature)
    return out
