"""Actor losses: DIS ratio mask (COPC/SAO), PPO clip, decoupled PPO (AReaL), TIS, IcePop, and
VAPO's positive-example LM term (:func:`positive_lm_loss`, added to any of them).

Every loss takes ``(B, T)`` tensors plus ``loss_mask`` and returns ``(loss, metrics)``.
Inputs at mask-0 positions are replaced by neutral values *before* any
differentiable operation, so garbage there (NaN, ±inf) changes neither the loss
nor any gradient. Advantages are treated as constants (detached). NaN in any input
at an action token raises ``ValueError`` naming it. PPO-style log-ratios are clamped
to ``±LOG_RATIO_CLAMP`` before ``exp`` (as verl does) so an overflowing ratio never
turns into a NaN gradient.
"""

from __future__ import annotations

import torch

from ._checks import as_bool_mask, check_2d_float, raise_if_not_finite
from .aggregation import Denominators, aggregate_loss, check_loss_agg_mode
from .margins import EPS_HIGH, EPS_LOW, margins
from .metrics import interval_fractions, ratio_statistics

Tensor = torch.Tensor

#: |log-ratio| bound applied before ``exp`` in the PPO-style losses (e^20 ≈ 4.9e8).
LOG_RATIO_CLAMP = 20.0


def _prepare(loss_mask: Tensor, loss_agg_mode: str, **tensors: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
    """Validate ``(B, T)`` inputs; return the bool mask and the inputs zeroed at mask-0."""
    check_loss_agg_mode(loss_agg_mode)
    first = next(iter(tensors))
    check_2d_float(first, tensors[first])
    m = as_bool_mask(loss_mask, tensors[first].shape)
    out = {}
    for name, t in tensors.items():
        check_2d_float(name, t, m.shape)
        out[name] = torch.where(m, t, 0.0)
        nan = torch.isnan(out[name].detach())
        if bool(nan.any()):
            b, i = (int(v) for v in nan.nonzero()[0])
            raise ValueError(f"{name}[{b}, {i}] = nan at an action token")
    return m, out


def _check_positive(**kw: float | None) -> None:
    for name, v in kw.items():
        if v is not None and not float(v) > 0.0:
            raise ValueError(f"{name} must be > 0, got {v!r}")


def ppo_token_loss(log_ratio: Tensor, advantages: Tensor, clip_low: float, clip_high: float,
                   dual_clip_c: float | None) -> tuple[Tensor, Tensor, Tensor]:
    """Per-token PPO clipped surrogate with clip-higher and dual clip.

    ``ℓ = max(−A·r, −A·clip(r, 1 − ε_low, 1 + ε_high))`` (Schulman et al. 2017, eq. 7;
    asymmetric "clip-higher" bounds from DAPO, Yu et al. 2025 §3.1); with dual clip
    (Ye et al. 2020, eq. 5) ``ℓ = min(ℓ, −c·A)`` where ``A < 0``.

    Args:
        log_ratio: ``(B, T)`` ``log r`` with grad (clamped to ``±LOG_RATIO_CLAMP`` before ``exp``).
        advantages: ``(B, T)`` advantages (treated as constants).
        clip_low, clip_high: ε_low, ε_high > 0.
        dual_clip_c: c > 1, or None to disable.

    Returns:
        ``(token_loss, clipped, dual_clipped)``: ``(B, T)`` float and two bool masks.
    """
    ratio = log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP).exp()
    adv = advantages.detach()
    l1 = -adv * ratio
    l2 = -adv * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    tok = torch.maximum(l1, l2)
    clipped = l2 > l1
    dual = torch.zeros_like(clipped)
    if dual_clip_c is not None:
        l3 = -adv * dual_clip_c
        dual = (adv < 0) & (tok > l3)
        tok = torch.where(dual, l3, tok)
    return tok, clipped, dual


def _ppo_checks(clip_low: float, clip_high: float, dual_clip_c: float | None) -> None:
    _check_positive(clip_low=clip_low, clip_high=clip_high)
    if clip_low >= 1.0:
        raise ValueError(f"clip_low must be < 1, got {clip_low!r}")
    if dual_clip_c is not None and not float(dual_clip_c) > 1.0:
        raise ValueError(f"dual_clip_c must be > 1 or None, got {dual_clip_c!r}")


def dis_policy_loss(logp: Tensor, logp_mu: Tensor, advantages: Tensor, loss_mask: Tensor, *,
                    eta_p: float = 0.5, eps_low: float = EPS_LOW, eps_high: float = EPS_HIGH,
                    loss_agg_mode: str = "seq-mean-token-mean", logp_old: Tensor | None = None,
                    ppo_clip_eps: float | None = None, denominators: Denominators | None = None
                    ) -> tuple[Tensor, dict[str, float]]:
    """COPC policy channel: the DIS token ratio mask (spec "Policy channel"; SAO's DIS).

    ``ρ_t = exp(logp_t − logp_mu_t)``, ``M_t = 1{ℓ_P < ρ_t < u_P}`` (strict, no gradient),
    ``L = −agg(M_t ρ_t Â_t)`` so ``∇L = −agg(M_t ρ_t ∇log π_θ(y_t) Â_t)``. The mask is
    recomputed from the current ``logp`` at each call, acting as the trust region w.r.t. µ.

    Optional extra PPO clip against π_old (spec **(choice)**, default off): with
    ``ppo_clip_eps = ε`` and ``logp_old`` given, the kept tokens use
    ``(π_old/µ)·max(−A r, −A clip(r, 1−ε, 1+ε))`` with ``r = π/π_old`` and ``π_old/µ`` detached.

    Args:
        logp: ``(B, T)`` float current log-probs (with grad).
        logp_mu: ``(B, T)`` float behavior log-probs.
        advantages: ``(B, T)`` float Â (detached inside).
        loss_mask: ``(B, T)`` bool/0-1, 1 on action tokens.
        eta_p: policy-channel strength η_P ∈ [0, 1]; (ℓ_P, u_P) = margins(η_P, ε_ℓ, ε_h).
        eps_low, eps_high: base margins.
        loss_agg_mode: see :mod:`copc.aggregation`; the denominators count *all* action
            tokens (masked ones included), as in ``(1/|y|) Σ_t M_t ρ_t Â_t``.
        logp_old: ``(B, T)`` learner log-probs before the update; needed only with ``ppo_clip_eps``.
        ppo_clip_eps: ε of the optional PPO clip, or None.
        denominators: global counts for micro-batching.

    Returns:
        ``(loss, metrics)`` with ``actor/dis_masked_frac`` (+ ``_low``/``_high``), ``actor/ratio_*``
        (π/µ, over all action tokens) and ``actor/pg_loss``. ``logp_mu = −inf`` gives ρ = inf:
        the token is masked (defined, no NaN in loss or gradient).

    Raises:
        ValueError: on bad shapes/mode/margins, ``ppo_clip_eps`` without ``logp_old``, or NaN
            inputs at action tokens (named in the message).
    """
    low, high = margins(eta_p, eps_low, eps_high)
    m, t = _prepare(loss_mask, loss_agg_mode, logp=logp, logp_mu=logp_mu, advantages=advantages)
    log_ratio = t["logp"] - t["logp_mu"]
    with torch.no_grad():
        rho_d = log_ratio.detach().exp()
        keep = (rho_d > low) & (rho_d < high) & m
    adv = t["advantages"].detach()
    if ppo_clip_eps is None:
        rho = torch.where(keep, log_ratio, 0.0).exp()
        tok = -rho * adv
    else:
        if logp_old is None:
            raise ValueError("dis_policy_loss: ppo_clip_eps is set but logp_old is None")
        _check_positive(ppo_clip_eps=ppo_clip_eps)
        check_2d_float("logp_old", logp_old, m.shape)
        lp_old = torch.where(keep, logp_old, 0.0).detach()
        lr_old = torch.where(keep, t["logp"] - lp_old, 0.0)
        ppo, _, _ = ppo_token_loss(lr_old, adv, ppo_clip_eps, ppo_clip_eps, None)
        w_old_mu = torch.where(keep, lp_old - t["logp_mu"], 0.0).detach().exp()
        tok = w_old_mu * ppo
    tok = torch.where(keep, tok, 0.0)
    loss = aggregate_loss(tok, m, loss_agg_mode, denominators)
    raise_if_not_finite((loss,), {"logp": logp, "logp_mu": logp_mu, "advantages": advantages}, m,
                        "dis_policy_loss")
    metrics = {"actor/pg_loss": float(loss.detach())}
    metrics.update(interval_fractions(rho_d, m, low, high, "actor", "dis_masked"))
    metrics.update(ratio_statistics(log_ratio, m, "actor"))
    return loss, metrics


def ppo_clip_policy_loss(logp: Tensor, logp_old: Tensor, advantages: Tensor, loss_mask: Tensor, *,
                         clip_low: float = 0.2, clip_high: float = 0.2,
                         dual_clip_c: float | None = None,
                         loss_agg_mode: str = "seq-mean-token-mean",
                         denominators: Denominators | None = None) -> tuple[Tensor, dict[str, float]]:
    """PPO clipped surrogate against π_old, ignoring µ (presets ``ppo``, ``ppo_async``, ``dapo``).

    See :func:`ppo_token_loss` for the formula (clip-higher: ``clip_high > clip_low``,
    e.g. DAPO's 0.2/0.28; dual clip: ``dual_clip_c``, e.g. 3).

    Args:
        logp: ``(B, T)`` float current log-probs (with grad).
        logp_old: ``(B, T)`` float log-probs before the update (no grad).
        advantages: ``(B, T)`` float.
        loss_mask: ``(B, T)`` bool/0-1.
        clip_low, clip_high: ε_low ∈ (0, 1), ε_high > 0.
        dual_clip_c: > 1 or None.
        loss_agg_mode, denominators: see :mod:`copc.aggregation`.

    Returns:
        ``(loss, metrics)``: ``actor/pg_loss``, ``actor/pg_clipfrac``, ``actor/pg_dual_clipfrac``,
        ``actor/approx_kl`` (k1 estimator, mean of ``logp_old − logp``), ``actor/ratio_*`` (π/π_old).

    Raises:
        ValueError: on bad shapes/mode or clip parameters, or NaN/inf inputs at action tokens
            (named in the message).
    """
    _ppo_checks(clip_low, clip_high, dual_clip_c)
    m, t = _prepare(loss_mask, loss_agg_mode, logp=logp, logp_old=logp_old, advantages=advantages)
    log_ratio = t["logp"] - t["logp_old"].detach()
    tok, clipped, dual = ppo_token_loss(log_ratio, t["advantages"], clip_low, clip_high, dual_clip_c)
    loss = aggregate_loss(tok, m, loss_agg_mode, denominators)
    raise_if_not_finite((loss,), {"logp": logp, "logp_old": logp_old, "advantages": advantages}, m,
                        "ppo_clip_policy_loss")
    return loss, _ppo_metrics(loss, log_ratio, clipped, dual, m)


def _ppo_metrics(loss: Tensor, log_ratio: Tensor, clipped: Tensor, dual: Tensor, m: Tensor
                 ) -> dict[str, float]:
    n = max(int(m.sum()), 1)
    out = {
        "actor/pg_loss": float(loss.detach()),
        "actor/pg_clipfrac": int((clipped & m).sum()) / n,
        "actor/pg_dual_clipfrac": int((dual & m).sum()) / n,
        "actor/approx_kl": float(-(log_ratio.detach().clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
                                     * m).sum()) / n,
    }
    out.update(ratio_statistics(log_ratio, m, "actor"))
    return out


def decoupled_ppo_policy_loss(logp: Tensor, logp_prox: Tensor, logp_mu: Tensor, advantages: Tensor,
                              loss_mask: Tensor, *, clip_low: float = 0.2, clip_high: float = 0.2,
                              dual_clip_c: float | None = None,
                              behav_weight_cap: float | None = 5.0, behav_cap_mode: str = "mask",
                              loss_agg_mode: str = "seq-mean-token-mean",
                              denominators: Denominators | None = None
                              ) -> tuple[Tensor, dict[str, float]]:
    """AReaL's decoupled PPO (Fu et al. 2025, "AReaL", eq. 5; preset ``areal``).

    ``ℓ = w · PPO-clip(π_θ/π_prox)`` with behavior weight ``w = π_prox/µ`` (detached).
    The proximal policy π_prox is the learner's policy before this step (``logp_old``).
    Cap (**(choice)**, ``behav_cap_mode``): ``"mask"`` drops tokens with ``w > cap`` (as
    AReaL's implementation does); ``"truncate"`` uses ``min(w, cap)``.

    Args:
        logp: ``(B, T)`` float current log-probs (with grad).
        logp_prox: ``(B, T)`` float proximal-policy log-probs (no grad).
        logp_mu: ``(B, T)`` float behavior log-probs.
        advantages, loss_mask: ``(B, T)``.
        clip_low, clip_high, dual_clip_c: see :func:`ppo_clip_policy_loss`.
        behav_weight_cap: cap > 0 on ``w``, or None for no cap.
        behav_cap_mode: ``"mask"`` or ``"truncate"``.
        loss_agg_mode, denominators: see :mod:`copc.aggregation`.

    Returns:
        ``(loss, metrics)``: PPO metrics plus ``actor/behav_capped_frac`` and
        ``behav/ratio_*`` statistics of π_prox/µ.

    Raises:
        ValueError: on bad shapes/mode/parameters, or NaN/inf inputs at action tokens that
            make the loss non-finite (the message names the input and position).
    """
    _ppo_checks(clip_low, clip_high, dual_clip_c)
    _check_positive(behav_weight_cap=behav_weight_cap)
    if behav_cap_mode not in ("mask", "truncate"):
        raise ValueError(f"behav_cap_mode must be 'mask' or 'truncate', got {behav_cap_mode!r}")
    m, t = _prepare(loss_mask, loss_agg_mode, logp=logp, logp_prox=logp_prox, logp_mu=logp_mu,
                    advantages=advantages)
    prox = t["logp_prox"].detach()
    log_ratio = t["logp"] - prox
    tok, clipped, dual = ppo_token_loss(log_ratio, t["advantages"], clip_low, clip_high, dual_clip_c)
    log_w = (prox - t["logp_mu"]).detach()
    w, capped = _capped_weight(log_w, m, behav_weight_cap, behav_cap_mode)
    tok = w * tok  # w is 0 on tokens dropped by the "mask" cap
    loss = aggregate_loss(tok, m, loss_agg_mode, denominators)
    raise_if_not_finite((loss,), {"logp": logp, "logp_prox": logp_prox, "logp_mu": logp_mu,
                                  "advantages": advantages}, m, "decoupled_ppo_policy_loss")
    metrics = _ppo_metrics(loss, log_ratio, clipped, dual, m)
    metrics["actor/behav_capped_frac"] = int((capped & m).sum()) / max(int(m.sum()), 1)
    metrics.update(ratio_statistics(log_w, m, "behav"))
    return loss, metrics


def _capped_weight(log_w: Tensor, m: Tensor, cap: float | None, mode: str) -> tuple[Tensor, Tensor]:
    """``exp(log_w)`` capped; returns (weight with masked tokens set to 0, capped mask)."""
    w = log_w.exp()
    if cap is None:
        return w, torch.zeros_like(m)
    capped = w > cap
    if mode == "truncate":
        return w.clamp(max=cap), capped
    return torch.where(capped, 0.0, w), capped


def tis_policy_loss(logp: Tensor, logp_old: Tensor, logp_mu: Tensor, advantages: Tensor,
                    loss_mask: Tensor, *, clip_low: float = 0.2, clip_high: float = 0.2,
                    dual_clip_c: float | None = None, tis_cap: float = 2.0,
                    loss_agg_mode: str = "seq-mean-token-mean",
                    denominators: Denominators | None = None) -> tuple[Tensor, dict[str, float]]:
    """Token-level truncated importance sampling on top of PPO clip (Yao et al. 2025, "TIS").

    ``ℓ = min(π_old/µ, C) · PPO-clip(π_θ/π_old)`` with the weight detached.

    Args:
        logp, logp_old, logp_mu, advantages, loss_mask: ``(B, T)`` as in
            :func:`decoupled_ppo_policy_loss` (``logp_old`` plays π_prox).
        clip_low, clip_high, dual_clip_c: PPO clip parameters.
        tis_cap: truncation C > 0 (default 2).
        loss_agg_mode, denominators: see :mod:`copc.aggregation`.

    Returns:
        ``(loss, metrics)``: PPO metrics plus ``actor/tis_truncated_frac``, ``behav/ratio_*``.

    Raises:
        ValueError: on bad shapes/mode/parameters, or NaN/inf inputs at action tokens that
            make the loss non-finite (the message names the input and position).
    """
    _check_positive(tis_cap=tis_cap)
    loss, metrics = decoupled_ppo_policy_loss(
        logp, logp_old, logp_mu, advantages, loss_mask, clip_low=clip_low, clip_high=clip_high,
        dual_clip_c=dual_clip_c, behav_weight_cap=tis_cap, behav_cap_mode="truncate",
        loss_agg_mode=loss_agg_mode, denominators=denominators)
    metrics["actor/tis_truncated_frac"] = metrics.pop("actor/behav_capped_frac")
    return loss, metrics


def icepop_policy_loss(logp: Tensor, logp_old: Tensor, logp_mu: Tensor, advantages: Tensor,
                       loss_mask: Tensor, *, clip_low: float = 0.2, clip_high: float = 0.2,
                       dual_clip_c: float | None = None, icepop_low: float = 0.5,
                       icepop_high: float = 5.0, loss_agg_mode: str = "seq-mean-token-mean",
                       denominators: Denominators | None = None) -> tuple[Tensor, dict[str, float]]:
    """IcePop: masked token-level importance weight (Ling Team 2025, Ring-1T report, §IcePop).

    ``ℓ = M(k) · PPO-clip(π_θ/π_old)`` with ``k = π_old/µ`` (detached) and
    ``M(k) = k`` if ``α ≤ k ≤ β`` else 0 (defaults α = 0.5, β = 5).

    Args:
        logp, logp_old, logp_mu, advantages, loss_mask: ``(B, T)`` as in :func:`tis_policy_loss`.
        clip_low, clip_high, dual_clip_c: PPO clip parameters.
        icepop_low, icepop_high: 0 < α < β.
        loss_agg_mode, denominators: see :mod:`copc.aggregation`.

    Returns:
        ``(loss, metrics)``: PPO metrics plus ``actor/icepop_masked_frac``, ``behav/ratio_*``.

    Raises:
        ValueError: on bad shapes/mode/parameters, or NaN/inf inputs at action tokens that
            make the loss non-finite (the message names the input and position).
    """
    _ppo_checks(clip_low, clip_high, dual_clip_c)
    _check_positive(icepop_low=icepop_low, icepop_high=icepop_high)
    if not icepop_low < icepop_high:
        raise ValueError(f"icepop_low ({icepop_low!r}) must be < icepop_high ({icepop_high!r})")
    m, t = _prepare(loss_mask, loss_agg_mode, logp=logp, logp_old=logp_old, logp_mu=logp_mu,
                    advantages=advantages)
    old = t["logp_old"].detach()
    log_ratio = t["logp"] - old
    tok, clipped, dual = ppo_token_loss(log_ratio, t["advantages"], clip_low, clip_high, dual_clip_c)
    log_k = (old - t["logp_mu"]).detach()
    k = log_k.exp()
    keep = (k >= icepop_low) & (k <= icepop_high) & m
    tok = torch.where(keep, k, 0.0) * tok  # k = inf outside the window must not reach the gradient
    loss = aggregate_loss(tok, m, loss_agg_mode, denominators)
    raise_if_not_finite((loss,), {"logp": logp, "logp_old": logp_old, "logp_mu": logp_mu,
                                  "advantages": advantages}, m, "icepop_policy_loss")
    metrics = _ppo_metrics(loss, log_ratio, clipped, dual, m)
    metrics["actor/icepop_masked_frac"] = int((~keep & m).sum()) / max(int(m.sum()), 1)
    metrics.update(ratio_statistics(log_k, m, "behav"))
    return loss, metrics


def positive_lm_loss(logp: Tensor, loss_mask: Tensor, positive: Tensor, *,
                     loss_agg_mode: str = "token-mean", denominators: Denominators | None = None
                     ) -> tuple[Tensor, dict[str, float]]:
    """VAPO's positive-example LM loss: NLL of the action tokens of positive episodes.

    ``L_NLL = agg_{t ∈ action tokens of positive episodes} (−log π_θ(y_t | s_t))`` (Yue et al.
    2025, "VAPO", arXiv 2504.05118, §3.3: token-mean over the correct answers' tokens;
    the actor loss becomes ``L_actor + μ · L_NLL``). Only the rows with ``positive[b]`` and
    their action tokens count: their number is the denominator (``N_tokens`` / ``N_seq`` of
    the positive part), so with ``token-mean`` this is the mean NLL per positive token, as in
    the paper. Other positions are replaced by 0 before any differentiable operation: garbage
    there (NaN, ±inf) changes neither the loss nor the gradient. No positive episode: 0.

    Args:
        logp: ``(B, T)`` float current log-probs (with grad).
        loss_mask: ``(B, T)`` bool/0-1, 1 on action tokens.
        positive: ``(B,)`` bool, True for the episodes to imitate (reward above a threshold).
        loss_agg_mode: see :mod:`copc.aggregation` (the actor loss's mode).
        denominators: counts of the *positive* action tokens/sequences of the whole
            mini-batch when ``logp`` is a micro-batch (``batch_denominators(loss_mask &
            positive[:, None])`` of the mini-batch); default: this batch's own.

    Returns:
        ``(loss, metrics)``: 0-dim tensor (``logp.dtype``) and ``actor/pos_lm_loss`` (the NLL,
        before the coefficient μ) and ``actor/pos_lm_token_frac`` (share of the action tokens
        that are in positive episodes).

    Raises:
        ValueError: on bad shapes/mode, a ``positive`` that is not ``(B,)``, or NaN in ``logp``
            at a counted token.
        TypeError: ``positive`` is not a bool tensor.
    """
    check_loss_agg_mode(loss_agg_mode)
    check_2d_float("logp", logp)
    m = as_bool_mask(loss_mask, logp.shape)
    if not isinstance(positive, torch.Tensor) or positive.dtype != torch.bool:
        raise TypeError(f"positive must be a bool tensor, got {getattr(positive, 'dtype', type(positive))}")
    if positive.shape != (m.shape[0],):
        raise ValueError(f"positive must have shape ({m.shape[0]},), got {tuple(positive.shape)}")
    pos = m & positive.to(m.device).unsqueeze(1)
    _, t = _prepare(pos, loss_agg_mode, logp=logp)  # zeroed outside pos, NaN inside raises
    loss = aggregate_loss(-t["logp"], pos, loss_agg_mode, denominators)
    raise_if_not_finite((loss,), {"logp": logp}, pos, "positive_lm_loss")
    n = max(int(m.sum()), 1)
    return loss, {"actor/pos_lm_loss": float(loss.detach()), "actor/pos_lm_token_frac": int(pos.sum()) / n}
