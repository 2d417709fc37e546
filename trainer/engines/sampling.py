"""Batched next-token sampling with per-row parameters, and the behavior log-probs.

Log-probs follow :mod:`trainer.logprobs`: ``log softmax(logits / T)[token]`` on the raw
logits, before top-k / top-p truncation (which only shapes *which* token is drawn).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..logprobs import token_logprobs
from .base import SamplingParams

Tensor = torch.Tensor


def filtered_logits(logits: Tensor, temperature: Tensor, top_k: Tensor, top_p: Tensor) -> Tensor:
    """Temperature-scaled logits with top-k / top-p truncation applied per row.

    Args:
        logits: ``(n, V)`` float32 raw logits.
        temperature: ``(n,)`` > 0.
        top_k: ``(n,)`` int64; ``<= 0`` disables.
        top_p: ``(n,)`` in (0, 1]; 1 disables.

    Returns:
        ``(n, V)`` float32 with ``-inf`` on excluded tokens (at least one token kept per row).
    """
    scaled = logits.float() / temperature[:, None]
    V = scaled.shape[1]
    sorted_logits, order = scaled.sort(dim=1, descending=True)
    rank = torch.arange(V, device=logits.device)[None, :]
    k = torch.where(top_k > 0, top_k.clamp(max=V), torch.full_like(top_k, V))
    drop = rank >= k[:, None]
    probs = torch.softmax(sorted_logits.masked_fill(drop, -torch.inf), dim=1)
    mass_before = probs.cumsum(1) - probs  # probability of strictly better tokens
    drop |= mass_before >= top_p[:, None]
    drop[:, 0] = False
    sorted_logits = sorted_logits.masked_fill(drop, -torch.inf)
    return torch.full_like(scaled, -torch.inf).scatter(1, order, sorted_logits)


def sample_next(logits: Tensor, params: Sequence[SamplingParams],
                generators: Sequence[torch.Generator | None],
                sampling_logits: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Sample one token per row and return ``(token_ids, behavior_logprobs)``.

    Args:
        logits: ``(n, V)`` raw logits of the last position of each row.
        params: per-row :class:`SamplingParams`.
        generators: per-row RNG (None: the global torch RNG).
        sampling_logits: optional processed logits to sample from instead of ``logits``;
            the returned log-probs still come from the raw ``logits``.

    Returns:
        ``(n,)`` int64 ids and ``(n,)`` float32 log-probs under ``softmax(logits / T)``.
    """
    dev = logits.device
    temp = torch.tensor([p.temperature for p in params], dtype=torch.float32, device=dev)
    top_k = torch.tensor([p.top_k for p in params], dtype=torch.long, device=dev)
    top_p = torch.tensor([p.top_p for p in params], dtype=torch.float32, device=dev)
    src = logits if sampling_logits is None else sampling_logits
    probs = torch.softmax(filtered_logits(src, temp, top_k, top_p), dim=1)
    ids = torch.empty(len(params), dtype=torch.long, device=dev)
    for i, g in enumerate(generators):
        ids[i] = torch.multinomial(probs[i], 1, generator=g)[0]
    lp = torch.stack([token_logprobs(logits[i], ids[i], params[i].temperature)
                      for i in range(len(params))])
    return ids, lp
