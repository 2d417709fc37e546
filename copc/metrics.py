"""Diagnostics every trainer logs (issue "copc/", item 9). Namespaced float dicts.

Per step: ratio statistics, the fraction of action tokens masked (policy channel) or
clipped (advantage channel) below/above their interval, staleness, the Kish effective
sample size of each channel's weights, mean |log ρ| per staleness level, and the critic's
value bias at the start of each episode (with its drift from an EMA).

All functions work on action tokens only (``loss_mask == 1``), ignore what sits
at mask-0 positions, take no gradient, and return plain Python floats.
"""

from __future__ import annotations

import math

import torch

from ._checks import as_bool_mask, check_2d_float
from .value_probes import first_values_and_returns

Tensor = torch.Tensor


@torch.no_grad()
def ratio_statistics(log_ratio: Tensor, loss_mask: Tensor, prefix: str) -> dict[str, float]:
    """Mean / max / min of ``ρ = exp(log_ratio)`` and its normalised effective sample size.

    ``ess = (Σρ)² / (n Σρ²)`` ∈ (0, 1] over the n action tokens (Kish 1965); 1 means
    all ratios equal. Non-finite ratios are excluded from mean/ESS and counted in
    ``{prefix}/ratio_nonfinite_frac``.

    Args:
        log_ratio: ``(B, T)`` float log-ratio (e.g. ``logp − logp_mu``).
        loss_mask: ``(B, T)`` bool/0-1 action-token mask.
        prefix: metric namespace, e.g. ``"actor"``.

    Returns:
        ``{prefix}/ratio_mean, ratio_max, ratio_min, ratio_ess, ratio_nonfinite_frac``
        (all 0.0 when there is no action token).

    Raises:
        ValueError/TypeError: if ``log_ratio`` is not a 2-D float tensor or the mask does not match.
    """
    check_2d_float("log_ratio", log_ratio)
    m = as_bool_mask(loss_mask, log_ratio.shape)
    rho = log_ratio.detach()[m].double().exp()
    keys = ("ratio_mean", "ratio_max", "ratio_min", "ratio_ess", "ratio_nonfinite_frac")
    if rho.numel() == 0:
        return {f"{prefix}/{k}": 0.0 for k in keys}
    fin = torch.isfinite(rho)
    r = rho[fin]
    n = max(r.numel(), 1)
    ess = float(r.sum() ** 2 / (n * r.square().sum())) if r.numel() and float(r.square().sum()) > 0 else 0.0
    return {
        f"{prefix}/ratio_mean": float(r.mean()) if r.numel() else 0.0,
        f"{prefix}/ratio_max": float(rho.max()),
        f"{prefix}/ratio_min": float(rho.min()),
        f"{prefix}/ratio_ess": ess,
        f"{prefix}/ratio_nonfinite_frac": 1.0 - r.numel() / rho.numel(),
    }


@torch.no_grad()
def interval_fractions(ratio: Tensor, loss_mask: Tensor, low: float, high: float, prefix: str,
                       name: str) -> dict[str, float]:
    """Fraction of action tokens with ratio at/below ``low`` and at/above ``high``.

    Matches the strict DIS interval ``low < ρ < high`` (spec "Policy channel"): a
    token with ρ exactly at a bound counts as outside. For a clip interval the same
    fractions are the clipped fractions (ρ at a bound is unchanged by the clip but
    is counted here, a negligible difference).

    Args:
        ratio: ``(B, T)`` float ratio ρ.
        loss_mask: ``(B, T)`` bool/0-1 action-token mask.
        low, high: the interval.
        prefix: namespace, e.g. ``"actor"``; name: e.g. ``"dis_masked"``.

    Returns:
        ``{prefix}/{name}_frac``, ``{prefix}/{name}_low_frac``, ``{prefix}/{name}_high_frac``.

    Raises:
        ValueError: if the mask is not 0/1 or does not match ``ratio``'s shape.
    """
    m = as_bool_mask(loss_mask, ratio.shape)
    n = max(int(m.sum()), 1)
    below = (ratio <= low) & m
    lo = int(below.sum())
    hi = int(((ratio >= high) & m & ~below).sum())  # a token is counted once, even if low == high
    return {
        f"{prefix}/{name}_frac": (lo + hi) / n,
        f"{prefix}/{name}_low_frac": lo / n,
        f"{prefix}/{name}_high_frac": hi / n,
    }


@torch.no_grad()
def advantage_channel_metrics(logp_old: Tensor, logp_mu: Tensor, loss_mask: Tensor, low: float,
                              high: float) -> dict[str, float]:
    """Fraction of action tokens whose TD residual weight ρ̄ is clipped, plus ratio stats.

    Args:
        logp_old: ``(B, T)`` learner log-probs before the update.
        logp_mu: ``(B, T)`` behavior log-probs.
        loss_mask: ``(B, T)`` action-token mask.
        low, high: the advantage-channel interval (ℓ_A, u_A) from :func:`copc.margins`.

    Returns:
        ``advantage/clipped_frac`` (+ ``_low_frac``/``_high_frac``: ρ < ℓ_A or ρ > u_A) and
        ``advantage/ratio_*`` statistics of π_old/µ.

    Raises:
        ValueError: if the mask is not 0/1 or does not match the log-probs' shape.
    """
    m = as_bool_mask(loss_mask, logp_old.shape)
    log_ratio = torch.where(m, logp_old - logp_mu, 0.0)
    rho = log_ratio.exp()
    n = max(int(m.sum()), 1)
    lo = int(((rho < low) & m).sum())
    hi = int(((rho > high) & m).sum())
    out = {
        "advantage/clipped_frac": (lo + hi) / n,
        "advantage/clipped_low_frac": lo / n,
        "advantage/clipped_high_frac": hi / n,
    }
    out.update(ratio_statistics(log_ratio, m, "advantage"))
    return out


@torch.no_grad()
def staleness_metrics(token_versions: Tensor, current_version: int, loss_mask: Tensor
                      ) -> dict[str, float]:
    """Staleness = learner version − version that generated each action token (spec "Setting").

    Args:
        token_versions: ``(B, T)`` integer policy version per token.
        current_version: the learner's policy version at train time.
        loss_mask: ``(B, T)`` action-token mask.

    Returns:
        ``staleness/mean``, ``staleness/max``, ``staleness/min`` over action tokens (0.0 if none).

    Raises:
        ValueError: if a token's version is newer than ``current_version`` (negative staleness).
    """
    m = as_bool_mask(loss_mask, token_versions.shape)
    s = (current_version - token_versions)[m]
    if s.numel() == 0:
        return {"staleness/mean": 0.0, "staleness/max": 0.0, "staleness/min": 0.0}
    if int(s.min()) < 0:
        raise ValueError(
            f"token_versions contains version {int(token_versions[m].max())} newer than "
            f"current_version {current_version}"
        )
    return {"staleness/mean": float(s.double().mean()), "staleness/max": float(s.max()),
            "staleness/min": float(s.min())}


# --------------------------------------------------------------------------------------------
# Per-step off-policy diagnostics (staleness, effective sample size, value bias).
# Formulas and 0/0 conventions are in each docstring; all ignore mask-0 positions.
# --------------------------------------------------------------------------------------------

@torch.no_grad()
def kish_ess_fraction(weights: Tensor, loss_mask: Tensor) -> float | None:
    """Kish effective sample size relative to N: ``ESS/N = (Σ w)² / (N Σ w²)`` over action tokens.

    Kish (1965), "Survey Sampling", eq. 11.7.4. ``ESS/N ∈ [1/N, 1]`` for non-negative weights
    with at least one positive one; 1 means all weights equal.

    Args:
        weights: ``(B, T)`` float non-negative per-token weights (values at mask-0 positions are
            ignored, NaN/inf there included).
        loss_mask: ``(B, T)`` bool/0-1 action-token mask.

    Returns:
        The fraction as a float (computed in float64). 0/0 cases: no action token (N = 0) →
        ``None`` (callers omit the metric); N > 0 but every weight 0 (Σw² = 0) → ``0.0`` (no
        effective sample). A non-finite weight at an action token gives NaN.

    Raises:
        TypeError/ValueError: if ``weights`` is not a 2-D float tensor or the mask does not match.
    """
    check_2d_float("weights", weights)
    m = as_bool_mask(loss_mask, weights.shape)
    w = weights.detach()[m].double()
    n = w.numel()
    if n == 0:
        return None
    sq = float(w.square().sum())
    if sq == 0.0:
        return 0.0
    return float(w.sum() ** 2 / (n * sq))


def _ratio_at_actions(logp_old: Tensor, logp_mu: Tensor, m: Tensor) -> Tensor:
    """float64 ``ρ = exp(logp_old − logp_mu)`` at action tokens, 1.0 at mask-0 positions."""
    check_2d_float("logp_old", logp_old, m.shape)
    check_2d_float("logp_mu", logp_mu, m.shape)
    log_ratio = torch.where(m, logp_old.detach().double() - logp_mu.detach().double(), 0.0)
    return log_ratio.exp()


@torch.no_grad()
def policy_channel_diagnostics(logp_old: Tensor, logp_mu: Tensor, loss_mask: Tensor, low: float,
                               high: float) -> dict[str, float]:
    """Policy channel (DIS mask) at the first optimizer step: masked fractions and Kish ESS/N.

    Spec "Policy channel": ``ρ_t = π_θ/µ`` taken with ``logp_old`` (the weights before the
    step, i.e. the mask of the first optimizer step), ``M_t = 1{ℓ_P < ρ_t < u_P}`` and the
    channel's weight ``w_t = ρ_t M_t`` (masked tokens weight 0). Unlike ``actor/dis_masked_*``
    (current θ, averaged over the updates) these are logged every step, also when the actor
    is not updated (critic warm-up).

    Args:
        logp_old: ``(B, T)`` float learner log-probs before the update.
        logp_mu: ``(B, T)`` float behavior log-probs.
        loss_mask: ``(B, T)`` bool/0-1 action-token mask.
        low, high: the policy-channel interval (ℓ_P, u_P) from :func:`copc.margins`.

    Returns:
        ``diag/policy_masked_frac``, ``diag/policy_masked_low_frac`` (ρ ≤ ℓ_P),
        ``diag/policy_masked_high_frac`` (ρ ≥ u_P) (0.0 when there is no action token) and
        ``diag/policy_ess_frac`` = :func:`kish_ess_fraction` of ``w`` (omitted without action
        tokens; 0.0 when every token is masked). ``logp_mu = −inf`` gives ρ = inf: masked, w = 0.

    Raises:
        TypeError/ValueError: bad shapes/dtypes or a mask that is not 0/1.
    """
    m = as_bool_mask(loss_mask, logp_old.shape)
    rho = _ratio_at_actions(logp_old, logp_mu, m)
    out = interval_fractions(rho, m, low, high, "diag", "policy_masked")
    keep = (rho > low) & (rho < high) & m
    ess = kish_ess_fraction(torch.where(keep, rho, 0.0), m)
    if ess is not None:
        out["diag/policy_ess_frac"] = ess
    return out


@torch.no_grad()
def advantage_channel_ess(logp_old: Tensor, logp_mu: Tensor, loss_mask: Tensor, low: float,
                          high: float) -> dict[str, float]:
    """Kish ESS/N of the advantage channel's TD-residual weights ``ρ̄_t = clip(ρ_t, ℓ_A, u_A)``.

    Spec "Advantage channel" (ρ_t with ``logp_old``, no grad); ESS/N as in :func:`kish_ess_fraction`.

    Args:
        logp_old: ``(B, T)`` float learner log-probs before the update.
        logp_mu: ``(B, T)`` float behavior log-probs.
        loss_mask: ``(B, T)`` bool/0-1 action-token mask.
        low, high: the advantage-channel interval (ℓ_A, u_A) from :func:`copc.margins`.

    Returns:
        ``{"diag/advantage_ess_frac": ESS/N}``, or ``{}`` when there is no action token.

    Raises:
        TypeError/ValueError: bad shapes/dtypes or a mask that is not 0/1.
    """
    m = as_bool_mask(loss_mask, logp_old.shape)
    rho_bar = _ratio_at_actions(logp_old, logp_mu, m).clamp(low, high)
    ess = kish_ess_fraction(rho_bar, m)
    return {} if ess is None else {"diag/advantage_ess_frac": ess}


@torch.no_grad()
def abs_log_ratio_by_staleness(logp_old: Tensor, logp_mu: Tensor, token_versions: Tensor,
                               current_version: int, loss_mask: Tensor) -> dict[str, float]:
    """Mean ``|log ρ_t| = |logp_old_t − logp_mu_t|`` over the action tokens of each staleness level.

    Staleness of a token ``k = current_version − token_versions`` (spec "Setting"). A growing
    mean with ``k`` shows how far µ drifts from the proximal policy per version of lag.

    Args:
        logp_old: ``(B, T)`` float learner log-probs before the update.
        logp_mu: ``(B, T)`` float behavior log-probs.
        token_versions: ``(B, T)`` integer policy version of each token.
        current_version: the learner's policy version at train time.
        loss_mask: ``(B, T)`` bool/0-1 action-token mask.

    Returns:
        ``{f"diag/abs_log_ratio_s{k}": mean}`` for every level ``k`` present among the action
        tokens (``{}`` without action tokens). Non-finite ``|log ρ|`` (e.g. ``logp_mu = −inf``)
        are left out of the mean (``advantage/ratio_nonfinite_frac`` counts them); a level whose
        tokens are all non-finite gets NaN.

    Raises:
        TypeError/ValueError: bad shapes/dtypes, a non-integer ``token_versions``, or a token
            version newer than ``current_version`` (negative staleness).
    """
    m = as_bool_mask(loss_mask, logp_old.shape)
    check_2d_float("logp_old", logp_old, m.shape)
    check_2d_float("logp_mu", logp_mu, m.shape)
    if token_versions.shape != m.shape or token_versions.is_floating_point():
        raise ValueError(f"token_versions must be an integer tensor of shape {tuple(m.shape)}, got "
                         f"{token_versions.dtype} {tuple(token_versions.shape)}")
    stale = (current_version - token_versions)[m]
    if stale.numel() and int(stale.min()) < 0:
        raise ValueError(f"token_versions contains version {int(token_versions[m].max())} newer than "
                         f"current_version {current_version}")
    a = (logp_old.detach().double() - logp_mu.detach().double())[m].abs()
    fin = torch.isfinite(a)
    out: dict[str, float] = {}
    for k in sorted(int(v) for v in torch.unique(stale)):
        sel = (stale == k) & fin
        out[f"diag/abs_log_ratio_s{k}"] = float(a[sel].mean()) if bool(sel.any()) else float("nan")
    return out


@torch.no_grad()
def value_bias_metrics(values: Tensor, rewards: Tensor, loss_mask: Tensor, gamma: float
                       ) -> dict[str, float]:
    """Critic bias at the start of each episode: ``V_first − R`` against the realised return.

    Per row b (one episode) with at least one action token: ``V_first`` = the value of the
    state before its first action token, ``R = Σ_j γ^j r_{t_j}`` over its action tokens
    ``t_0 < t_1 < …`` (j = index among action tokens, spec "Setting": observation tokens are
    skipped, not discounted; with γ = 1, R is the episode's total reward). Rewards at mask-0
    positions are ignored (:func:`trainer.rollout.batch.to_batch` never puts any there).

    Args:
        values: ``(B, T)`` float critic values ``V(s_t)`` before the update (``values_old``).
        rewards: ``(B, T)`` float per-token rewards.
        loss_mask: ``(B, T)`` bool/0-1 action-token mask.
        gamma: discount γ ∈ [0, 1] per action token.

    Returns:
        ``critic/value_bias = mean_b(V_first − R)``, ``critic/value_bias_abs = mean_b |V_first − R|``
        over the rows that have an action token; ``{}`` when no row has one.

    Raises:
        TypeError/ValueError: bad shapes/dtypes, a mask that is not 0/1, or γ outside [0, 1].
    """
    check_2d_float("values", values)
    m = as_bool_mask(loss_mask, values.shape)
    check_2d_float("rewards", rewards, m.shape)
    if not 0.0 <= float(gamma) <= 1.0:
        raise ValueError(f"gamma must be in [0, 1], got {gamma!r}")
    v_first, ret, rows = first_values_and_returns(values, rewards, m, gamma)
    if not bool(rows.any()):
        return {}
    err = (v_first - ret)[rows]
    return {"critic/value_bias": float(err.mean()), "critic/value_bias_abs": float(err.abs().mean())}


def ema_drift(value: float, ema: float | None, decay: float = 0.9) -> tuple[float, float | None]:
    """Drift of ``value`` from the exponential moving average of earlier values, and the new EMA.

    ``drift = value − ema`` (0.0 when ``ema`` is None, i.e. at the first step), then
    ``ema ← decay · ema + (1 − decay) · value`` (initialised to ``value`` at the first step).
    A non-finite ``value`` gives NaN drift and leaves the EMA unchanged.

    Args:
        value: this step's value (e.g. ``critic/value_bias``).
        ema: the EMA of the previous steps, or None before the first one.
        decay: EMA decay in [0, 1).

    Returns:
        ``(drift, new_ema)``.

    Raises:
        ValueError: if ``decay`` is outside [0, 1).
    """
    if not 0.0 <= float(decay) < 1.0:
        raise ValueError(f"decay must be in [0, 1), got {decay!r}")
    value = float(value)
    if not math.isfinite(value):
        return float("nan"), ema
    if ema is None:
        return 0.0, value
    return value - ema, decay * ema + (1.0 - decay) * value
