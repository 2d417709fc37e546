"""Diagnostics every trainer logs (issue "copc/", item 9). Namespaced float dicts.

All functions work on action tokens only (``loss_mask == 1``), ignore what sits
at mask-0 positions, take no gradient, and return plain Python floats.
"""

from __future__ import annotations

import torch

from ._checks import as_bool_mask, check_2d_float

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
