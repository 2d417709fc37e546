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
        When no row truncates, the scaled logits are returned without sorting; when rows use
        top-k but none top-p, only the ``max k`` best tokens per row are selected (``topk``),
        no full sort.
    """
    scaled = logits.float() / temperature[:, None]
    use_k, use_p = top_k > 0, top_p < 1
    if not bool((use_k | use_p).any()):
        return scaled
    V = scaled.shape[1]
    if not bool(use_p.any()):
        k = top_k.clamp(max=V)
        vals, idx = scaled.topk(int(k.max()), dim=1)
        vals = vals.masked_fill(torch.arange(vals.shape[1], device=logits.device)[None, :] >= k[:, None],
                                -torch.inf)
        kept = torch.full_like(scaled, -torch.inf).scatter(1, idx, vals)
        return torch.where(use_k[:, None], kept, scaled)
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


def draw(scores: Tensor, uniforms: Tensor) -> Tensor:
    """Inverse-CDF draw of one token per row from ``softmax(scores)``.

    Token ``i`` is drawn when ``u · Z`` falls in ``[c_{i-1}, c_i)``, ``c`` the float64 cumulative
    sum of ``exp(scores − max)`` and ``Z`` its total, so a token of probability 0 (``-inf``
    score) is never drawn. One uniform per row: a seeded row's tokens depend on its own
    generator only, and the cost is a cumulative sum instead of ``torch.multinomial``'s
    exponential variate per vocabulary entry.

    Args:
        scores: ``(n, V)`` float, at least one finite entry per row.
        uniforms: ``(n,)`` float64 in ``[0, 1)``.

    Returns:
        ``(n,)`` int64 token ids.
    """
    w = (scores - scores.max(dim=1, keepdim=True).values).exp()
    cdf = w.cumsum(dim=1, dtype=torch.float64)
    u = uniforms.to(cdf)[:, None] * cdf[:, -1:]
    ids = torch.searchsorted(cdf, u, right=True).squeeze(1)
    return ids.clamp(max=scores.shape[1] - 1)


def sample_next(logits: Tensor, params: Sequence[SamplingParams],
                generators: Sequence[torch.Generator | None],
                sampling_logits: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Sample one token per row and return ``(token_ids, behavior_logprobs)``.

    Rows with ``top_k == 1`` take the arg-max (greedy; no random number is used). The others
    are drawn with :func:`draw` from their filtered distribution: rows without a generator take
    their uniforms from one batched ``torch.rand`` on the global torch RNG; a row with its own
    (seeded) generator takes its uniform from it, so a seeded request gives the same tokens
    whatever else is in the batch. Log-probs are computed with
    :func:`trainer.logprobs.token_logprobs` once per distinct temperature.

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
    src = logits if sampling_logits is None else sampling_logits
    ids = src.argmax(dim=1)
    drawn = [i for i, p in enumerate(params) if p.top_k != 1]
    if drawn:
        sub = drawn if len(drawn) < n else slice(None)
        ps = [params[i] for i in drawn]
        temp = torch.tensor([p.temperature for p in ps], dtype=torch.float32, device=dev)
        top_k = torch.tensor([p.top_k for p in ps], dtype=torch.long, device=dev)
        top_p = torch.tensor([p.top_p for p in ps], dtype=torch.float32, device=dev)
        u = torch.rand(len(drawn), dtype=torch.float64, device=dev)
        for j, i in enumerate(drawn):
            if generators[i] is not None:
                u[j] = torch.rand((), dtype=torch.float64, device=dev, generator=generators[i])
        ids[sub] = draw(filtered_logits(src[sub], temp, top_k, top_p), u)
    temps = [p.temperature for p in params]
    if len(set(temps)) == 1:
        return ids, token_logprobs(logits, ids, temps[0])
    lp = torch.empty(n, dtype=torch.float32, device=dev)
    for t in set(temps):
        idx = torch.tensor([i for i, ti in enumerate(temps) if ti == t], device=dev)
        lp[idx] = token_logprobs(logits[idx], ids[idx], t)
    return ids, lp
