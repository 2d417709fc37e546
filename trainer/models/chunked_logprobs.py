"""Token log-probs and entropies from hidden states, the LM head applied in chunks of tokens.

The convention is :func:`trainer.logprobs.token_logprobs` (the one definition shared with the
rollout engines): ``log softmax(z)[token]`` with ``z = float32(logits) / temperature`` and
``logits = scale · (h Wᵀ + b)`` the model's raw logits. The difference is memory: the full
``(N, V)`` logits are never held. :func:`chunked_token_scores` computes them ``chunk_tokens`` rows
at a time, keeps only the ``(N,)`` results, and saves for backward only what it was given (hidden
states, head weight, targets); the backward recomputes each chunk's logits and turns them into
gradients w.r.t. the hidden states and the head weight/bias at once (:class:`ChunkedHeadScores`).
Peak extra memory is a few ``(chunk_tokens, V)`` float32 buffers instead of several ``(N, V)`` ones.

With top-k / top-p truncation (``top_k > 1`` or ``top_p < 1``, :func:`trainer.logprobs.truncates`)
``z`` is first restricted to the sampler's support (:func:`trainer.logprobs.support_logits`, the
function the embedded sampler draws with): ``-inf`` outside, so ``p`` is the truncated,
renormalised distribution, a target outside the support gets log-prob ``-inf``, and the support is a
constant of the gradient (``p_j = 0`` and ``∂/∂z_j = 0`` outside it; ``l_j`` is taken as 0 there).

Gradients (per row, ``p = softmax(z)``, ``l = log p = z − log Z``, ``H = −Σ_j p_j l_j``, ``g`` /
``e`` the incoming gradients of the log-prob / entropy)::

    ∂ log p_y / ∂z_j = 1[j = y] − p_j,          ∂H / ∂z_j = −p_j (l_j + H),
    ∂L/∂logits = scale · (g (1_y − p) − e p (l + H)) / temperature,
    ∂L/∂h = ∂L/∂logits · W,   ∂L/∂W = Σ_rows ∂L/∂logitsᵀ h,   ∂L/∂b = Σ_rows ∂L/∂logits.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.nn import functional

from ..logprobs import truncated_scores, truncates
from .settings import DEFAULT_CHUNK_TOKENS  # defined without torch (the learner's settings read it)

Tensor = torch.Tensor


def chunk_logits(h: Tensor, weight: Tensor, bias: Tensor | None, scale: float, temperature: float) -> Tensor:
    """``(n, V)`` float32 ``z = float32(scale · (h Wᵀ + b)) / temperature`` of one chunk (the same
    operations, in the same order and dtypes, as the model's head followed by
    :func:`trainer.logprobs.token_logprobs`)."""
    logits = functional.linear(h, weight, bias)
    if scale != 1.0:
        logits = logits * scale
    z = logits.float()
    return z / temperature if temperature != 1.0 else z


def chunk_scores(h: Tensor, weight: Tensor, bias: Tensor | None, scale: float, temperature: float,
                 top_k: int, top_p: float) -> Tensor:
    """:func:`chunk_logits` restricted to the sampler's top-k / top-p support
    (:func:`trainer.logprobs.truncated_scores`: ``-inf`` outside; unchanged without truncation)."""
    return truncated_scores(chunk_logits(h, weight, bias, scale, temperature), top_k, top_p)


class ChunkedHeadScores(torch.autograd.Function):
    """``(log p(targets), entropy)`` of ``softmax(z)`` per row, chunked (see the module docstring).

    ``forward(hidden (N, H), weight (V, H), bias (V,) | None, targets (N,) int64, scale, temperature,
    chunk_tokens, with_entropy, top_k, top_p)`` returns two float32 tensors: ``(N,)`` log-probs and ``(N,)``
    entropies (``(0,)`` when ``with_entropy`` is false). Saved for backward: the inputs only.
    """

    @staticmethod
    def forward(ctx: Any, hidden: Tensor, weight: Tensor, bias: Tensor | None, targets: Tensor, scale: float,
                temperature: float, chunk_tokens: int, with_entropy: bool, top_k: int = -1,
                top_p: float = 1.0) -> tuple[Tensor, Tensor]:
        n, cut = hidden.shape[0], truncates(top_k, top_p)
        logp = torch.empty(n, dtype=torch.float32, device=hidden.device)
        ent = torch.empty(n if with_entropy else 0, dtype=torch.float32, device=hidden.device)
        for s in range(0, n, chunk_tokens):
            e = min(s + chunk_tokens, n)
            z = chunk_scores(hidden[s:e], weight, bias, scale, temperature, top_k, top_p)
            logz = torch.logsumexp(z, dim=-1)
            logp[s:e] = z.gather(-1, targets[s:e, None]).squeeze(-1) - logz
            if with_entropy:  # H = −Σ p l with l = z − log Z (log-probs: no cancellation against log Z)
                logq = z.sub_(logz[:, None])
                p = logq.exp()
                if cut:  # outside the support p = 0 and l = -inf: the term is 0
                    logq = logq.masked_fill_(p == 0, 0.0)
                ent[s:e] = -(p * logq).sum(-1)
        ctx.save_for_backward(hidden, weight, bias, targets)
        ctx.cfg = (scale, temperature, chunk_tokens, top_k, top_p)
        ctx.set_materialize_grads(False)  # an unused output (the entropy of a loss without it): None
        return logp, ent

    @staticmethod
    def backward(ctx: Any, g_logp: Tensor | None, g_ent: Tensor | None) -> tuple[Tensor | None, ...]:
        """Gradients w.r.t. ``hidden``, ``weight`` and ``bias``, one recomputed chunk at a time."""
        hidden, weight, bias, targets = ctx.saved_tensors
        scale, temperature, chunk_tokens, top_k, top_p = ctx.cfg
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        n = hidden.shape[0]
        if g_ent is not None and g_ent.numel() == 0:
            g_ent = None
        if g_logp is None and g_ent is None:
            return (None,) * 10
        grad_h = torch.empty_like(hidden) if need_h else None
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_w else None
        grad_b = torch.zeros(bias.shape, dtype=torch.float32, device=bias.device) if need_b else None
        for s in range(0, n, chunk_tokens):
            e = min(s + chunk_tokens, n)
            h = hidden[s:e]
            dz = _grad_z(chunk_scores(h, weight, bias, scale, temperature, top_k, top_p), targets[s:e],
                         None if g_logp is None else g_logp[s:e], None if g_ent is None else g_ent[s:e],
                         truncates(top_k, top_p))
            if temperature != 1.0:
                dz = dz.div_(temperature)
            dl = dz.to(hidden.dtype)
            if scale != 1.0:
                dl = dl * scale
            if need_h:
                grad_h[s:e] = dl @ weight
            if need_w:
                if dl.dtype == torch.float32:
                    grad_w.addmm_(dl.t(), h)
                else:
                    grad_w += (dl.t() @ h).float()
            if need_b:
                grad_b += dl.sum(0, dtype=torch.float32)
        return (grad_h, None if grad_w is None else grad_w.to(weight.dtype),
                None if grad_b is None else grad_b.to(bias.dtype), None, None, None, None, None, None, None)


def _grad_z(z: Tensor, targets: Tensor, g_logp: Tensor | None, g_ent: Tensor | None,
            truncated: bool = False) -> Tensor:
    """``∂L/∂z`` ``(n, V)`` float32 of one chunk, from its ``z`` (overwritten) and the incoming
    gradients of the log-probs / entropies (either may be None: not used by the loss).
    ``truncated``: ``z`` holds ``-inf`` outside the sampler's support (there ``p = 0``, ``l`` is
    taken as 0, and the gradient is 0).

    The entropy term is written with the log-probs ``l = z − log Z``: ``−p (l − E_p[l])`` (equal to
    ``−p (z − E_p[z])``; ``E_p[l] = −H`` is small where ``E_p[z]`` is not, so less rounding)."""
    logq = z.sub_(torch.logsumexp(z, dim=-1, keepdim=True))
    p = logq.exp()
    if truncated:
        logq = logq.masked_fill_(p == 0, 0.0)
    if g_ent is not None:
        neg_h = (p * logq).sum(-1, keepdim=True)  # E_p[l] = −H
        dz = logq.sub_(neg_h).mul_(p).mul_(-g_ent[:, None])  # −e p (l − E_p[l])
        if g_logp is not None:
            dz.sub_(p.mul_(g_logp[:, None]))
    elif g_logp is not None:
        dz = p.mul_(-g_logp[:, None])
    else:
        return logq.zero_()
    if g_logp is not None:
        dz.scatter_add_(-1, targets[:, None], g_logp[:, None].to(dz.dtype))
    return dz


def chunked_token_scores(hidden: Tensor, weight: Tensor, targets: Tensor, *, bias: Tensor | None = None,
                         temperature: float = 1.0, scale: float = 1.0,
                         chunk_tokens: int = DEFAULT_CHUNK_TOKENS, entropy: bool = False,
                         top_k: int = -1, top_p: float = 1.0) -> tuple[Tensor, Tensor | None]:
    """Log-prob of each target token (and the entropy of each row's distribution) under
    ``softmax(float32(scale · (hidden Wᵀ + bias)) / temperature)`` (truncated to the sampler's
    top-k / top-p support and renormalised when ``top_k > 1`` or ``top_p < 1``: the convention of
    :func:`trainer.logprobs.token_logprobs`), never holding more than ``chunk_tokens`` rows of
    logits (forward or backward).

    Args:
        hidden: ``(N, H)`` hidden states (any float dtype: the head runs in it, as in the model),
            the final norm applied: the LM head's input at the position *before* each target.
        weight: ``(V, H)`` LM head weight (same dtype). bias: ``(V,)`` or None.
        targets: ``(N,)`` int64 token ids in ``[0, V)``.
        temperature: > 0, the sampling temperature (log-probs of ``logits / temperature``).
        scale: the model's own logit multiplier (1 for Llama / Qwen2; Cohere's ``logit_scale``;
            ``1 / logits_scaling`` for Granite).
        chunk_tokens: rows per chunk, >= 1.
        entropy: also return the entropy ``H = −Σ_j p_j log p_j`` (nats) of each row's
            temperature-scaled (and truncated) distribution (differentiable too).
        top_k / top_p: the rollout's truncation (-1 and 1: none; greedy ``top_k == 1`` is untruncated).

    Returns:
        ``(logp, entropy)``: ``(N,)`` float32 each (entropy None when not asked for; log-prob
        ``-inf`` for a target outside the support); differentiable w.r.t. ``hidden``, ``weight``
        and ``bias``.

    Raises:
        ValueError: ``temperature <= 0``, ``chunk_tokens < 1`` or shapes that do not line up.
    """
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature!r}")
    if isinstance(chunk_tokens, bool) or not isinstance(chunk_tokens, int) or chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be an int >= 1, got {chunk_tokens!r}")
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1] \
            or targets.shape != hidden.shape[:1]:
        raise ValueError(f"hidden {tuple(hidden.shape)}, weight {tuple(weight.shape)} and targets "
                         f"{tuple(targets.shape)} must be (N, H), (V, H) and (N,)")
    logp, ent = ChunkedHeadScores.apply(hidden, weight, bias, targets, float(scale), float(temperature),
                                        chunk_tokens, entropy, int(top_k), float(top_p))
    return logp, (ent if entropy else None)
