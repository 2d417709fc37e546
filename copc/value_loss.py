"""Clipped value regression for the critic (spec, "Critic loss")."""

from __future__ import annotations

import torch

from ._checks import as_bool_mask, check_2d_float, raise_if_not_finite
from .aggregation import Denominators, aggregate_loss

Tensor = torch.Tensor


def value_loss(values: Tensor, values_old: Tensor, returns: Tensor, loss_mask: Tensor, *,
               clip_eps: float | None = 0.5, loss_agg_mode: str = "token-mean",
               denominators: Denominators | None = None) -> tuple[Tensor, dict[str, float]]:
    """Clipped value loss ``½ · agg max((V − v̂)², (V_clip − v̂)²)`` over action tokens.

    Spec "Critic loss" (PPO value clipping, as in Schulman et al. 2017's
    reference implementation): ``V_clip = V_old + clip(V − V_old, −ε_V, ε_V)``.
    Tokens masked by the policy channel still count here: the policy mask touches
    only the actor loss.

    Args:
        values: ``(B, T)`` float current critic values (with grad).
        values_old: ``(B, T)`` float critic values before the update (no grad).
        returns: ``(B, T)`` float targets v̂ (e.g. COPC corrected returns).
        loss_mask: ``(B, T)`` bool/0-1, 1 on action tokens.
        clip_eps: ε_V > 0, or None for the unclipped ``½ (V − v̂)²``.
        loss_agg_mode: see :mod:`copc.aggregation` (spec: "same aggregation options as the actor").
        denominators: global counts when the batch is split into micro-batches.

    Returns:
        ``(loss, metrics)``: 0-dim tensor and ``critic/…`` floats (``vf_clipfrac`` — fraction of
        action tokens where the clipped branch is active; ``value_mean``; ``return_mean``;
        ``explained_variance``).

    Raises:
        ValueError: on mismatched shapes, ``clip_eps <= 0`` or NaN/inf inputs at action tokens.
    """
    check_2d_float("values", values)
    m = as_bool_mask(loss_mask, values.shape)
    check_2d_float("values_old", values_old, values.shape)
    check_2d_float("returns", returns, values.shape)
    if clip_eps is not None and not float(clip_eps) > 0.0:
        raise ValueError(f"clip_eps must be > 0 or None, got {clip_eps!r}")
    v = torch.where(m, values, 0.0)
    v_old = torch.where(m, values_old, 0.0).detach()
    ret = torch.where(m, returns, 0.0).detach()
    err = (v - ret).square()
    if clip_eps is None:
        tok = 0.5 * err
        clipped = torch.zeros_like(m)
    else:
        v_clip = v_old + (v - v_old).clamp(-clip_eps, clip_eps)
        err_clip = (v_clip - ret).square()
        tok = 0.5 * torch.maximum(err, err_clip)
        clipped = (err_clip > err) & m
    loss = aggregate_loss(tok, m, loss_agg_mode, denominators)
    raise_if_not_finite((loss,), {"values": values, "values_old": values_old, "returns": returns}, m,
                        "value_loss")
    with torch.no_grad():
        n = max(int(m.sum()), 1)
        r_sel, v_sel = returns.detach()[m], values.detach()[m]
        var_r = r_sel.var(unbiased=False) if r_sel.numel() else torch.tensor(0.0)
        ev = 1.0 - (r_sel - v_sel).var(unbiased=False) / var_r if float(var_r) > 0 else torch.tensor(0.0)
        metrics = {
            "critic/vf_clipfrac": float(clipped.sum()) / n,
            "critic/value_mean": float(v_sel.mean()) if v_sel.numel() else 0.0,
            "critic/return_mean": float(r_sel.mean()) if r_sel.numel() else 0.0,
            "critic/explained_variance": float(ev),
        }
    return loss, metrics
