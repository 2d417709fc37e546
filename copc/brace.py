"""BRACE critic targets: V-trace with the correction horizon capped at ``k`` policy tokens.

BRACE ("anchored Bellman-residual correction", arXiv 2609.09783) limits the off-policy
correction of the critic target to the first ``k`` policy (action) tokens after ``t`` and lets
the rest of the episode enter as a Monte-Carlo tail with constant weight. No code of the paper
exists; the recursion here is written from a third-party description, and ``docs/algorithm.md``
("BRACE") states it with that caveat. Over action tokens ``s`` (observation tokens skipped: they
neither discount nor consume ``k``), with ``ratio_s = exp(logp_old_s − logp_mu_s)``::

    ρ_s = min(ρ̄, ratio_s),   c_s = λ · min(c̄, ratio_s)          (V-trace weights and traces)
    D⁽⁰⁾_s = Σ_{j≥s} γ^{j−s} δ_j                                 (Monte-Carlo tail, anchored)
    D⁽ᵐ⁾_s = ρ_s δ_s + γ c_s D⁽ᵐ⁻¹⁾_{s+1}      m = 1 … k         (D after the last token = 0)
    returns_s = V_s + D⁽ᵏ⁾_s                                      (critic target v_s)
    advantages_s = ρ_s (δ_s + γ D⁽ᵏ⁾_{s+1})                       (as V-trace's, Espeholt §4.2)

Unrolled: ``D⁽ᵏ⁾_t = Σ_j γ^{j−t} (Π_{i=t}^{j−1} c̃_i) ρ̃_j δ_j`` where ``c̃_i, ρ̃_j`` equal the
V-trace factors on the first ``k`` action tokens ``t … t+k−1`` and 1 beyond them: the product of
traces is capped at ``k`` factors, and with γ = 1 the tail telescopes into
``Π c̃ · (Σ_{j≥t+k} r_j + V_boot − V_{t+k})``, a Monte-Carlo return anchored at ``V_{t+k}``.
``k ≥`` the number of action tokens is exactly V-trace (:func:`copc.vtrace_advantage_return`).

That is the default reading of the tail, ``tail="product_kept"``. The description ("gives the
tail a constant weight of 1") also reads as ``tail="literal"``: residuals beyond the prefix enter
with weight ``γ^{j−t}`` and no product of traces,
``D_t = P⁽ᵏ⁾_t + γ^k D⁽⁰⁾_{t+k}`` with ``P⁽ᵏ⁾`` the recursion above started from 0 (the first ``k``
V-trace terms) and ``D⁽⁰⁾_{t+k}`` the Monte-Carlo tail ``k`` action tokens later (0 past the row).
The two agree on-policy with λ = 1 and for ``k ≥`` the row's action tokens; otherwise they differ
by ``γ^k (Π_{i<t+k} c_i − 1) D⁽⁰⁾_{t+k}`` (:class:`BraceSettings` states the default's source).

The work is ``min(k, L)`` dense passes over the action tokens packed to the left (``L`` the
longest row's count), each one fused multiply-add: no Python loop over tokens.
"""

from __future__ import annotations

import torch

from ._checks import check_number, raise_if_not_finite
from .advantages import check_row_lambda, prepare_estimator_inputs
from .component_settings import (  # noqa: F401 - BraceSettings re-exported (defined without torch)
    DEFAULT_HORIZON,
    BraceSettings,
    check_brace_tail,
    check_horizon,
)
from .scan import action_block_bounds, reverse_action_scan, td_residuals

Tensor = torch.Tensor

def _pack(x: Tensor, mask: Tensor, pos: Tensor, L: int) -> Tensor:
    """Action tokens of ``x`` packed to the left: ``(B, L)``, 0 after each row's last one."""
    out = torch.zeros(x.shape[0], L + 1, dtype=x.dtype, device=x.device)
    out.scatter_(1, torch.where(mask, pos, L), torch.where(mask, x, 0.0))
    return out[:, :L]


def _unpack(packed: Tensor, mask: Tensor, pos: Tensor) -> Tensor:
    """Inverse of :func:`_pack`: ``(B, T)``, 0 at mask-0 positions."""
    return torch.where(mask, packed.gather(1, pos.clamp(min=0)), 0.0)


def _shift(d: Tensor, n: int = 1) -> Tensor:
    """``d`` ``n`` packed positions later (0 past the last)."""
    return torch.nn.functional.pad(d[:, n:], (0, min(n, d.shape[1])))


def brace_advantage_return(rewards: Tensor, values: Tensor, logp_old: Tensor, logp_mu: Tensor,
                           loss_mask: Tensor, *, gamma: float = 1.0, lam: float | Tensor = 1.0,
                           rho_clip: float = 1.2, c_clip: float = 1.1,
                           horizon: int = DEFAULT_HORIZON, bootstrap_values: Tensor | None = None,
                           obs_reward: str = "fold", tail: str = "product_kept") -> tuple[Tensor, Tensor]:
    """BRACE critic targets and actor advantages (module docstring; ``docs/algorithm.md``, BRACE).

    Args:
        rewards, values, logp_old, logp_mu, loss_mask: ``(B, T)`` as
            :func:`copc.coupled_advantage_return` (values and log-probs read at action tokens
            only; rewards on observation tokens folded onto the preceding action token).
        gamma, lam: γ, λ ∈ [0, 1]; ``lam`` may be a ``(B,)`` float tensor of per-row trace λ.
        rho_clip: ρ̄ > 0 (paper 1.2). c_clip: c̄ > 0 (paper 1.1).
        horizon: ``k`` ≥ 1 policy tokens of correction (paper 100); ``k`` ≥ the longest row's
            action-token count gives V-trace exactly.
        bootstrap_values: optional ``(B,)`` V after the last action token (truncated rows).
        obs_reward: ``"fold"`` or ``"error"`` (see :func:`copc.gae_advantage_return`).
        tail: ``"product_kept"`` (default) or ``"literal"``: the weight of the residuals beyond
            the ``k``-token prefix (module docstring; :class:`BraceSettings`).

    Returns:
        ``(advantages, returns)``, each ``(B, T)`` with ``values.dtype`` (float32 for half
        inputs), 0 at mask-0 positions, detached.

    Raises:
        ValueError: as :func:`copc.vtrace_advantage_return`, plus ``horizon`` not an int ≥ 1, or
            ``tail`` not ``"product_kept"`` / ``"literal"`` (``"tail=…: must be one of …"``).
        TypeError: on non-tensor or non-floating inputs.
    """
    mask, x = prepare_estimator_inputs(rewards, values, loss_mask, gamma, lam, bootstrap_values, "skip",
                       logp_old=logp_old, logp_mu=logp_mu)
    for name, v in (("rho_clip", rho_clip), ("c_clip", c_clip)):
        if not check_number(name, v) > 0.0:
            raise ValueError(f"{name} must be > 0, got {v!r}")
    check_horizon(horizon)
    check_brace_tail(tail)
    values = x["values"]
    B, T = values.shape
    if isinstance(lam, Tensor):
        check_row_lambda(lam, B)
    if T == 0:
        return torch.zeros_like(values), torch.zeros_like(values)
    starts, ends = action_block_bounds(mask)
    delta = td_residuals(x["rewards"], values, mask, gamma, x["bootstrap_values"], starts, ends, obs_reward)
    delta = torch.where(mask, delta, 0.0)
    # D⁽⁰⁾_s = Σ_{j≥s} γ^{j−s} δ_j over action tokens (the scan returns G at the next one)
    mc_tail = torch.add(delta, reverse_action_scan(delta, mask, gamma), alpha=gamma)
    pos = mask.cumsum(1) - 1
    L = int(pos[:, -1].max()) + 1
    with torch.no_grad():
        ratio = torch.where(mask, torch.sub(x["logp_old"], x["logp_mu"]), 0.0).exp()
    rho = ratio.clamp(max=rho_clip)
    lam_t = lam.to(values.device, values.dtype).unsqueeze(1) if isinstance(lam, Tensor) else lam
    p_rd = _pack(rho * delta, mask, pos, L)
    p_gc = _pack(gamma * lam_t * ratio.clamp(max=c_clip), mask, pos, L)
    mc = _pack(mc_tail, mask, pos, L)
    d = mc if tail == "product_kept" else torch.zeros_like(mc)  # literal: the prefix sum P⁽ᵏ⁾ first
    for _ in range(min(horizon, L)):  # beyond L passes nothing changes (every row is V-trace)
        d = torch.addcmul(p_rd, p_gc, _shift(d))
    if tail == "literal" and horizon < L:
        d = torch.add(d, _shift(mc, horizon), alpha=gamma ** horizon)
    returns = _unpack(d, mask, pos).add_(values)
    advantages = rho * (delta + gamma * _unpack(_shift(d), mask, pos))
    advantages = torch.where(mask, advantages, 0.0)
    returns = torch.where(mask, returns, 0.0)
    inputs = {"rewards": (x["rewards"], torch.ones_like(mask)), "values": values,
              "logp_old": x["logp_old"], "logp_mu": x["logp_mu"]}
    if x["bootstrap_values"] is not None:
        inputs["bootstrap_values"] = x["bootstrap_values"]
    raise_if_not_finite((advantages, returns), inputs, mask, "brace_advantage_return")
    return advantages, returns
