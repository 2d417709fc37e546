"""Batched next-token sampling with per-row parameters, and the behavior log-probs.

Log-probs follow :mod:`trainer.logprobs`: the log-prob of the drawn token under the distribution it
was drawn from, computed from the raw logits: ``log softmax(logits / T)[token]`` without truncation,
renormalised over the top-k / top-p support (:func:`trainer.logprobs.support_logits`) with it.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..logprobs import support_logits, token_logprobs, truncates
from .base import SamplingParams

Tensor = torch.Tensor


def filtered_logits(logits: Tensor, temperature: Tensor, top_k: Tensor, top_p: Tensor) -> Tensor:
    """Temperature-scaled logits with top-k / top-p truncation applied per row: the sampler's
    support, :func:`trainer.logprobs.support_logits` of ``logits.float() / temperature`` (the
    function the learner's log-probs use, so the two cannot drift).

    Args:
        logits: ``(n, V)`` float32 raw logits.
        temperature: ``(n,)`` > 0.
        top_k: ``(n,)`` int64; ``<= 0`` disables.
        top_p: ``(n,)`` in (0, 1]; 1 disables.

    Returns:
        ``(n, V)`` float32 with ``-inf`` on excluded tokens (at least one token kept per row).
    """
    return support_logits(logits.float() / temperature[:, None], top_k, top_p)


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
    :func:`trainer.logprobs.token_logprobs` once per distinct ``(temperature, top_k, top_p)``:
    over the truncated, renormalised support when the row truncates
    (:func:`trainer.logprobs.truncates`), the learner's convention.

    Args:
        logits: ``(n, V)`` raw logits of the last position of each row.
        params: per-row :class:`SamplingParams` (``len == n``).
        generators: per-row RNG (None: the global torch RNG), ``len == n``.
        sampling_logits: optional ``(n, V)`` processed logits to sample from instead of
            ``logits``; the returned log-probs still come from the raw ``logits`` (with the
            row's truncation).

    Returns:
        ``(n,)`` int64 ids and ``(n,)`` float32 log-probs (:func:`trainer.logprobs.token_logprobs`).

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
    keys = [(p.temperature, p.top_k, p.top_p) for p in params]
    if len(set(keys)) == 1:
        lp = _behavior_logprobs(logits, ids, *keys[0])
    else:
        lp = torch.empty(n, dtype=torch.float32, device=dev)
        for key in set(keys):
            idx = torch.tensor([i for i, k in enumerate(keys) if k == key], device=dev)
            lp[idx] = _behavior_logprobs(logits[idx], ids[idx], *key)
    return ids, lp


def _behavior_logprobs(logits: Tensor, ids: Tensor, temperature: float, top_k: int, top_p: float) -> Tensor:
    """``(n,)`` float32 :func:`trainer.logprobs.token_logprobs` of ``ids`` under the raw ``logits``
    with one ``(temperature, top_k, top_p)``. A token outside the raw support (only possible when
    a logits processor chose it from other logits) keeps its untruncated log-prob, so µ is always
    finite; the learner then finds it outside π's support (ratio 0, masked)."""
    lp = token_logprobs(logits, ids, temperature, top_k=top_k, top_p=top_p)
    if truncates(top_k, top_p):
        out = torch.isneginf(lp)
        if bool(out.any()):
            lp = torch.where(out, token_logprobs(logits, ids, temperature), lp)
    return lp
