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
        When no row truncates, the scaled logits are returned without sorting.
    """
    scaled = logits.float() / temperature[:, None]
    use_k, use_p = top_k > 0, top_p < 1
    if not bool((use_k | use_p).any()):
        return scaled
    V = scaled.shape[1]
    sorted_logits, order = scaled.sort(dim=1, descending=True)
    rank = torch.arange(V, device=logits.device)[None, :]
    k = torch.where(use_k, top_k.clamp(max=V), torch.full_like(top_k, V))
    drop = rank >= k[:, None]
    probs = torch.softmax(sorted_logits.masked_fill(drop, -torch.inf), dim=1)
    mass_before = probs.cumsum(1) - probs  # probability of strictly better tokens
    drop |= (mass_before >= top_p[:, None]) & use_p[:, None]  # top_p = 1: no rounding-off of the tail
    drop[:, 0] = False
    sorted_logits = sorted_logits.masked_fill(drop, -torch.inf)
    return torch.full_like(scaled, -torch.inf).scatter(1, order, sorted_logits)


def sample_next(logits: Tensor, params: Sequence[SamplingParams],
                generators: Sequence[torch.Generator | None],
                sampling_logits: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Sample one token per row and return ``(token_ids, behavior_logprobs)``.

    Rows without a generator are drawn with one batched ``torch.multinomial`` call on the
    global torch RNG; rows with their own (seeded) generator are drawn one by one, so a
    seeded request gives the same tokens whatever else is in the batch. Log-probs are
    computed with :func:`trainer.logprobs.token_logprobs` once per distinct temperature.

    Args:
        logits: ``(n, V)`` raw logits of the last position of each row.
        params: per-row :class:`SamplingParams` (``len == n``).
        generators: per-row RNG (None: the global torch RNG), ``len == n``.
        sampling_logits: optional ``(n, V)`` processed logits to sample from instead of
            ``logits``; the returned log-probs still come from the raw ``logits``.

    Returns:
        ``(n,)`` int64 ids and ``(n,)`` float32 log-probs under ``softmax(logits / T)``.

    Raises:
        ValueError: if ``params`` or ``generators`` do not have one entry per row.
    """
    n = logits.shape[0]
    if len(params) != n or len(generators) != n:
        raise ValueError(f"sample_next: {n} logit rows but {len(params)} params and "
                         f"{len(generators)} generators")
    dev = logits.device
    temps = [p.temperature for p in params]
    temp = torch.tensor(temps, dtype=torch.float32, device=dev)
    top_k = torch.tensor([p.top_k for p in params], dtype=torch.long, device=dev)
    top_p = torch.tensor([p.top_p for p in params], dtype=torch.float32, device=dev)
    src = logits if sampling_logits is None else sampling_logits
    probs = torch.softmax(filtered_logits(src, temp, top_k, top_p), dim=1)
    seeded = [i for i, g in enumerate(generators) if g is not None]
    if not seeded:
        ids = torch.multinomial(probs, 1).squeeze(1)
    else:
        ids = torch.empty(n, dtype=torch.long, device=dev)
        free = [i for i, g in enumerate(generators) if g is None]
        if free:
            idx = torch.tensor(free, device=dev)
            ids[idx] = torch.multinomial(probs[idx], 1).squeeze(1)
        for i in seeded:
            ids[i] = torch.multinomial(probs[i], 1, generator=generators[i])[0]
    if len(set(temps)) == 1:
        return ids, token_logprobs(logits, ids, temps[0])
    lp = torch.empty(n, dtype=torch.float32, device=dev)
    for t in set(temps):
        idx = torch.tensor([i for i, ti in enumerate(temps) if ti == t], device=dev)
        lp[idx] = token_logprobs(logits[idx], ids[idx], t)
    return ids, lp
