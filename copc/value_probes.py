"""Value diagnostics referenced to the current policy π, beside the µ-referenced value bias.

:func:`copc.metrics.value_bias_metrics` compares the critic with the returns the batch realised,
i.e. with the behaviour policy µ: it reads ``V̂ − V^µ``, which is not 0 for a perfect critic of π
once µ ≠ π (stale rollouts). Here the reference is π, estimated from the same batch by
self-normalised, capped sequence importance sampling (no extra episodes):

    w_b = min(exp(Σ_t∈b (logp_old_t − logp_mu_t)), C)            (episode b's weight π/µ, capped)
    Ê_µ[R] = mean_b R_b,   Ê_π[R] = Σ_b w_b R_b / Σ_b w_b
    value/policy_value_gap = | mean_b V̂(first action token of b) − Ê_π[R] |
    value/b_hat            = Ê_π[R] − Ê_µ[R]

(Owen 2013, "Monte Carlo theory, methods and examples", §9.2 self-normalised importance
sampling; the cap is Ionides' truncated IS, 2008.) Bias: self-normalisation is consistent but
biased at finite batch size (O(1/B)); the cap C biases Ê_π towards Ê_µ when π puts much more mass
on some episodes than µ — ``value/seq_weight_capped_frac`` says how often it bit, and
``value/seq_weight_ess_frac`` (Kish ESS/B of the weights) how many episodes the estimate rests on.
With µ = π every weight is 1 and Ê_π = Ê_µ, b̂ = 0. On a token tree with the exact V^π as critic
the gap is 0 up to sampling error (``tests/copc/test_value_probes.py``).

Standard errors (``value/se_gap``, ``value/se_b_hat``): the delta-method (linearised)
variance of the ratio estimator, the weights taken as given (Owen 2013, §9.2: the self-normalised
estimate's variance Σ_b w_b² (R_b − Ê_π)² / (Σ_b w_b)²). With ``w̄ = Σ_b w_b / n`` each episode's
influence on the signed gap ``d = mean_b V̂_b − Ê_π`` and on b̂ is

    ψ^d_b = (V̂_b − mean V̂) − w_b (R_b − Ê_π) / w̄,     ψ^b_b = w_b (R_b − Ê_π) / w̄ − (R_b − Ê_µ[R])
    SE = √(Σ_b ψ_b²) / n

A V^π critic's |d| exceeds 2 SE in about 5 % of batches; the gap is evidence against the critic
tracking π only where it does. :mod:`copc.value_probe_window` pools these over steps.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ._checks import as_bool_mask, check_2d_float
from .component_settings import DEFAULT_SEQ_WEIGHT_CAP

Tensor = torch.Tensor



@dataclass(frozen=True)
class ProbeTerms:
    """Per-episode terms of the probes, float64 ``(n,)`` each over the ``n`` episodes (rows with an
    action token): ``v`` V̂ before the first action token, ``r`` the return R, ``w`` the capped
    weight min(π/µ, C), ``capped`` 1.0 where the cap bit (else 0.0)."""

    v: Tensor
    r: Tensor
    w: Tensor
    capped: Tensor

    @staticmethod
    def cat(parts: list[ProbeTerms]) -> ProbeTerms:
        """The episodes of every part, in order (pooling batches: each episode counts once)."""
        return ProbeTerms(*(torch.cat([getattr(p, f) for p in parts]) for f in ("v", "r", "w", "capped")))


def first_values_and_returns(values: Tensor, rewards: Tensor, m: Tensor, gamma: float
                             ) -> tuple[Tensor, Tensor, Tensor]:
    """Per row: ``V̂`` before its first action token and ``R = Σ_j γ^j r_{t_j}`` over its action
    tokens (spec "Setting"), float64 ``(B,)`` each, and the ``(B,)`` bool rows with an action token."""
    rows = m.any(dim=1)
    first = m.long().argmax(dim=1)
    v_first = values.detach().double().gather(1, first[:, None]).squeeze(1)
    j = (m.long().cumsum(dim=1) - 1).clamp(min=0).double()
    disc = torch.full_like(j, float(gamma)).pow(j)  # 0**0 == 1
    ret = torch.where(m, disc * rewards.detach().double(), 0.0).sum(dim=1)
    return v_first, ret, rows


@torch.no_grad()
def probe_terms(values: Tensor, rewards: Tensor, logp_old: Tensor, logp_mu: Tensor, loss_mask: Tensor,
                gamma: float, *, weight_cap: float = DEFAULT_SEQ_WEIGHT_CAP) -> ProbeTerms | None:
    """The :class:`ProbeTerms` of a batch (arguments as :func:`policy_value_metrics`); None
    without a row with an action token, or when a weight is not finite or all are 0.

    Raises:
        TypeError/ValueError: as :func:`policy_value_metrics`.
    """
    check_2d_float("values", values)
    m = as_bool_mask(loss_mask, values.shape)
    for name, t in (("rewards", rewards), ("logp_old", logp_old), ("logp_mu", logp_mu)):
        check_2d_float(name, t, m.shape)
    if not 0.0 <= float(gamma) <= 1.0:
        raise ValueError(f"gamma must be in [0, 1], got {gamma!r}")
    if not weight_cap > 0:
        raise ValueError(f"weight_cap must be > 0, got {weight_cap!r}")
    v_first, ret, rows = first_values_and_returns(values, rewards, m, gamma)
    if not bool(rows.any()):
        return None
    log_w = torch.where(m, logp_old.double() - logp_mu.double(), 0.0).sum(dim=1)[rows]
    capped = log_w > math.log(weight_cap)
    w = log_w.clamp(max=math.log(weight_cap)).exp()
    if not bool(torch.isfinite(w).all()) or float(w.sum()) == 0.0:
        return None
    return ProbeTerms(v_first[rows], ret[rows], w, capped.double())


def probe_metrics(t: ProbeTerms, suffix: str = "", prefix: str = "") -> dict[str, float]:
    """The probes of the episodes ``t`` (module docstring): ``value/policy_value_gap``,
    ``value/b_hat``, their standard errors ``value/se_gap`` (of the signed gap) and
    ``value/se_b_hat``, ``value/seq_weight_ess_frac``, ``value/seq_weight_capped_frac`` (each
    ``value/<prefix><name><suffix>``)."""
    n, w, r = t.w.numel(), t.w, t.r
    w_sum = w.sum()
    e_pi = (w * r).sum() / w_sum
    e_mu = r.mean()
    v_mean = t.v.mean()
    is_part = w * (r - e_pi) / (w_sum / n)  # the self-normalised mean's influence
    se_gap = float(((t.v - v_mean) - is_part).square().sum().sqrt()) / n
    se_b = float((is_part - (r - e_mu)).square().sum().sqrt()) / n
    values = {"policy_value_gap": abs(float(v_mean) - float(e_pi)), "b_hat": float(e_pi) - float(e_mu),
              "se_gap": se_gap, "se_b_hat": se_b,
              "seq_weight_ess_frac": float(w_sum ** 2 / (n * w.square().sum())),
              "seq_weight_capped_frac": float(t.capped.mean())}
    return {f"value/{prefix}{k}{suffix}": v for k, v in values.items()}


@torch.no_grad()
def policy_value_metrics(values: Tensor, rewards: Tensor, logp_old: Tensor, logp_mu: Tensor,
                         loss_mask: Tensor, gamma: float, *, weight_cap: float = DEFAULT_SEQ_WEIGHT_CAP,
                         suffix: str = "") -> dict[str, float]:
    """The π-referenced value probes of a batch (module docstring).

    Args:
        values: ``(B, T)`` float critic values before the update. rewards: ``(B, T)`` float.
        logp_old: ``(B, T)`` float proximal (π) log-probs. logp_mu: ``(B, T)`` float behaviour ones.
        loss_mask: ``(B, T)`` bool/0-1 action-token mask. gamma: γ ∈ [0, 1].
        weight_cap: C > 0. suffix: appended to every key (e.g. ``"_s2"``).

    Returns:
        :func:`probe_metrics` of the batch's episodes; ``{}`` without a row with an action token,
        or when a weight is not finite (a NaN log-ratio).

    Raises:
        TypeError/ValueError: bad shapes/dtypes, γ outside [0, 1], ``weight_cap`` not > 0.
    """
    t = probe_terms(values, rewards, logp_old, logp_mu, loss_mask, gamma, weight_cap=weight_cap)
    return {} if t is None else probe_metrics(t, suffix)


@torch.no_grad()
def policy_value_by_staleness(values: Tensor, rewards: Tensor, logp_old: Tensor, logp_mu: Tensor,
                              token_versions: Tensor, current_version: int, loss_mask: Tensor,
                              gamma: float, *, weight_cap: float = DEFAULT_SEQ_WEIGHT_CAP
                              ) -> dict[str, float]:
    """:func:`policy_value_metrics` of the whole batch and of each staleness level ``k`` (keys
    ``…_s{k}``): an episode's level is ``current_version −`` its oldest action token's version.

    Raises:
        ValueError: as :func:`policy_value_metrics`, or ``token_versions`` not an integer tensor of
            the mask's shape.
    """
    m = as_bool_mask(loss_mask, values.shape)
    if token_versions.shape != m.shape or token_versions.is_floating_point():
        raise ValueError(f"token_versions must be an integer tensor of shape {tuple(m.shape)}, got "
                         f"{token_versions.dtype} {tuple(token_versions.shape)}")
    args = (values, rewards, logp_old, logp_mu)
    out = policy_value_metrics(*args, m, gamma, weight_cap=weight_cap)
    big = torch.iinfo(token_versions.dtype).max
    oldest = torch.where(m, token_versions, big).min(dim=1).values
    level = current_version - oldest
    for k in sorted(int(x) for x in torch.unique(level[m.any(dim=1)])):
        rows = level == k
        out.update(policy_value_metrics(*(t[rows] for t in args), m[rows], gamma, weight_cap=weight_cap,
                                        suffix=f"_s{k}"))
    return out
