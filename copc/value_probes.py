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
"""

from __future__ import annotations

import math

import torch

from ._checks import as_bool_mask, check_2d_float

Tensor = torch.Tensor

#: Default cap C of the episode weights π/µ.
DEFAULT_SEQ_WEIGHT_CAP = 10.0


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
        ``value/policy_value_gap``, ``value/b_hat``, ``value/seq_weight_ess_frac``,
        ``value/seq_weight_capped_frac`` (each + ``suffix``); ``{}`` without a row with an action
        token, or when a weight is not finite (a NaN log-ratio).

    Raises:
        TypeError/ValueError: bad shapes/dtypes, γ outside [0, 1], ``weight_cap`` not > 0.
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
        return {}
    log_w = torch.where(m, logp_old.double() - logp_mu.double(), 0.0).sum(dim=1)[rows]
    capped = log_w > math.log(weight_cap)
    w = log_w.clamp(max=math.log(weight_cap)).exp()
    if not bool(torch.isfinite(w).all()) or float(w.sum()) == 0.0:
        return {}
    r, v = ret[rows], v_first[rows]
    e_pi = float((w * r).sum() / w.sum())
    e_mu = float(r.mean())
    return {f"value/policy_value_gap{suffix}": abs(float(v.mean()) - e_pi),
            f"value/b_hat{suffix}": e_pi - e_mu,
            f"value/seq_weight_ess_frac{suffix}": float(w.sum() ** 2 / (w.numel() * w.square().sum())),
            f"value/seq_weight_capped_frac{suffix}": float(capped.double().mean())}


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
