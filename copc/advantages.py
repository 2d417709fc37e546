"""Advantage estimators over action tokens: COPC coupled returns, GAE, V-trace.

All take ``(B, T)`` tensors aligned on response tokens plus ``loss_mask``
``(B, T)`` (1 = action token, 0 = observation/padding) and return
``(advantages, returns)``, each ``(B, T)`` with the dtype of ``values`` and
exactly 0 at mask-0 positions. Recursions run over action tokens only:
observation tokens are skipped, not discounted per token; reward on an
observation token is folded onto the preceding action token; V after the last
action token is 0 unless a bootstrap value is given (spec, "Setting").

Values at mask-0 positions of ``values``, ``logp_old`` and ``logp_mu`` are never
read: any garbage there leaves every output bit-identical. ``rewards`` at mask-0
positions *are* read (they are folded), so padding must carry zero reward.

Dtypes: float32 and float64 are computed in their own precision; float16/bfloat16
inputs are computed in float32 and the outputs are float32. Inputs are detached:
outputs never carry gradient history. ``T = 0`` gives empty outputs.

``lam`` is a float, or a ``(B,)`` tensor of per-row λ (VAPO's length-adaptive GAE,
:func:`length_adaptive_lambda`): GAE and COPC then run once per distinct λ on its rows
(:func:`per_row_lambda`), so each row is exactly the scalar-λ estimator on that row alone.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ._checks import (
    as_bool_mask,
    check_1d,
    check_2d_float,
    check_number,
    check_unit_interval,
    raise_if_not_finite,
)
from ._scalars import OBS_DISCOUNT_MODES  # defined without torch (config validation reads it)
from .margins import EPS_HIGH, EPS_LOW, margins
from .scan import action_block_bounds, reverse_action_scan, td_residuals

Tensor = torch.Tensor


def length_adaptive_lambda(loss_mask: Tensor, alpha: float) -> Tensor:
    """Per-row λ of VAPO's length-adaptive GAE: ``λ_b = clip(1 − 1/(α · l_b), 0, 1)``.

    Yue et al. 2025, "VAPO" (arXiv 2504.05118) §3.2, ``λ_policy = 1 − 1/(α l)`` with ``l`` the
    sequence length (paper α = 0.05). Here ``l_b`` is the number of *action* tokens of row ``b``
    (the length of the recursion, observation tokens being skipped). Short rows with
    ``α l_b ≤ 1`` get ``λ = 0`` (the paper's formula would go negative); rows without action
    tokens get 0 as well (their outputs are all zeros whatever λ).

    Args:
        loss_mask: ``(B, T)`` bool/0-1, 1 on action tokens.
        alpha: α > 0 (larger α → λ closer to 1).

    Returns:
        ``(B,)`` float64 tensor in ``[0, 1]`` on ``loss_mask``'s device.

    Raises:
        ValueError: on a bad mask or ``alpha`` that is not a number > 0.
    """
    if not check_number("length_adaptive_alpha", alpha) > 0.0:
        raise ValueError(f"length_adaptive_alpha must be > 0, got {alpha!r}")
    lengths = as_bool_mask(loss_mask).sum(1).to(torch.float64)
    return torch.rsub(1.0 / (alpha * lengths), 1.0).clamp_(0.0, 1.0)  # l = 0: 1 − inf → 0


def check_row_lambda(lam: Tensor, n_rows: int) -> None:
    """Check a per-row λ: a ``(B,)`` floating tensor with every value in ``[0, 1]``.

    Raises:
        TypeError: ``lam`` is not a floating tensor.
        ValueError: wrong shape, or a value outside ``[0, 1]`` or NaN (named with its row).
    """
    check_1d("lam", lam, n_rows)
    bad = ~((lam >= 0.0) & (lam <= 1.0))  # NaN is bad too
    if bool(bad.any()):
        b = int(bad.nonzero()[0])
        raise ValueError(f"lam[{b}] = {float(lam[b])!r}: per-row lambda must be in [0, 1]")


def per_row_lambda(estimate: Callable[[float, Tensor], tuple[Tensor, Tensor]], lam: Tensor,
                   n_rows: int) -> tuple[Tensor, Tensor]:
    """Run a scalar-λ estimator once per distinct value of a per-row ``lam`` and reassemble.

    ``estimate(λ, rows)`` must return ``(advantages, returns)`` of the batch rows ``rows``
    (an int64 index tensor) computed with the scalar ``λ``; rows are independent in every
    estimator here, so the result is exactly the estimator run row by row with its own λ.
    Cost: one call per distinct λ (at most ``B``).

    Args:
        estimate: the scalar-λ estimator restricted to some rows.
        lam: ``(B,)`` float per-row λ, each finite and in ``[0, 1]``.
        n_rows: ``B``.

    Returns:
        ``(advantages, returns)``, ``(B, T)`` each, with the dtype ``estimate`` returns.

    Raises:
        ValueError: if ``lam`` is not ``(B,)`` or has a value outside ``[0, 1]`` (named with its
            row); a ``ValueError`` of ``estimate`` gets the batch rows of its λ appended.
        TypeError: if ``lam`` is not a floating tensor.
    """
    check_row_lambda(lam, n_rows)
    if n_rows == 0:
        return estimate(1.0, torch.zeros(0, dtype=torch.long, device=lam.device))
    values, inverse = torch.unique(lam, return_inverse=True)
    order = torch.argsort(inverse, stable=True)
    groups = order.split(torch.bincount(inverse, minlength=values.numel()).tolist())
    out: tuple[Tensor, Tensor] | None = None
    for v, rows in zip(values.tolist(), groups, strict=True):
        try:
            adv, ret = estimate(v, rows)
        except ValueError as e:
            raise ValueError(f"{e} (row indices within the rows with lam = {v!r}: batch rows "
                             f"{rows.tolist()[:8]})") from None
        if out is None:
            out = (adv.new_zeros((n_rows, adv.shape[1])), ret.new_zeros((n_rows, ret.shape[1])))
        out[0][rows], out[1][rows] = adv, ret
    assert out is not None
    return out


def _rows(t: Tensor | None, rows: Tensor) -> Tensor | None:
    return None if t is None else t[rows]


def prepare_estimator_inputs(rewards: Tensor, values: Tensor, loss_mask: Tensor, gamma: float,
                             lam: float | Tensor, bootstrap_values: Tensor | None, obs_discount: str,
                             **extra: Tensor) -> tuple[Tensor, dict[str, Tensor | None]]:
    """Validate an advantage estimator's inputs; return the bool mask and detached inputs.

    Args:
        rewards, values: ``(B, T)`` float; ``loss_mask``: ``(B, T)`` bool or 0/1.
        gamma, lam: in [0, 1] (``lam`` also a ``(B,)`` per-row tensor).
        bootstrap_values: ``(B,)`` or None. obs_discount: one of ``OBS_DISCOUNT_MODES``.
        extra: further ``(B, T)`` float inputs (e.g. ``logp_old``, ``logp_mu``), by name.

    Returns:
        ``(mask, inputs)``: the ``(B, T)`` bool mask and ``name → detached tensor`` (None kept);
        half-precision inputs upcast to float32 (the scans rescale by ``(γλ)^{−L}``, which
        float16 cannot hold).

    Raises:
        ValueError: a shape, dtype or hyper-parameter out of range, naming it.
    """
    mask = as_bool_mask(loss_mask)
    check_2d_float("values", values, mask.shape)
    check_2d_float("rewards", rewards, mask.shape)
    for name, t in extra.items():
        check_2d_float(name, t, mask.shape)
    check_unit_interval("gamma", gamma)
    if isinstance(lam, Tensor):
        check_1d("lam", lam, mask.shape[0])
    else:
        check_unit_interval("lam", lam)
    if obs_discount not in OBS_DISCOUNT_MODES:
        raise ValueError(f"obs_discount must be one of {OBS_DISCOUNT_MODES}, got {obs_discount!r}")
    if bootstrap_values is not None:
        check_1d("bootstrap_values", bootstrap_values, values.shape[0])
    dtype = torch.float32 if values.dtype in (torch.float16, torch.bfloat16) else values.dtype
    out = {"rewards": rewards, "values": values, "bootstrap_values": bootstrap_values, **extra}
    return mask, {k: None if v is None else v.detach().to(dtype) for k, v in out.items()}


def _td_corrected(rewards: Tensor, values: Tensor, mask: Tensor, rho_bar: Tensor | None,
                  gamma: float, lam: float, bootstrap_values: Tensor | None, obs_reward: str,
                  obs_discount: str, inputs: dict[str, Tensor], context: str) -> tuple[Tensor, Tensor]:
    """Shared core of GAE and COPC: ``G_t = ρ̄_t δ_t + γλ G_{t+1}`` over action tokens.

    ``rho_bar is None`` means ρ̄ ≡ 1 (plain GAE) and multiplies nothing, so
    GAE and COPC with η_A = 0 are bit-identical.
    """
    if mask.shape[1] == 0:
        return torch.zeros_like(values), torch.zeros_like(values)
    starts, ends = action_block_bounds(mask)
    delta = td_residuals(rewards, values, mask, gamma, bootstrap_values, starts, ends, obs_reward,
                         obs_discount)
    # Few big temporaries: every fresh (B, T) buffer costs page faults on first touch.
    zero = torch.zeros((), dtype=delta.dtype, device=delta.device)
    x = torch.where(mask, delta, zero) if rho_bar is None else torch.where(
        mask, rho_bar.mul_(delta), zero, out=rho_bar)
    c = gamma * lam
    g_next = reverse_action_scan(x, mask if obs_discount == "skip" else torch.ones_like(mask), c)
    # Â_t = δ_t + γλ G_{next}: the token's own residual is not reweighted.
    advantages = torch.add(delta, g_next, alpha=c)
    torch.where(mask, advantages, zero, out=advantages)
    # v̂_t = V_t + G_t = V_t + x_t + γλ G_{next}
    returns = g_next.mul_(c) if c != 1.0 else g_next
    returns.add_(x).add_(values)
    torch.where(mask, returns, zero, out=returns)
    everywhere = torch.ones_like(mask)
    scan = {**inputs, "rewards": (rewards, everywhere)}
    if bootstrap_values is not None:
        scan["bootstrap_values"] = bootstrap_values
    raise_if_not_finite((advantages, returns), scan, mask, context)
    return advantages, returns


def gae_advantage_return(rewards: Tensor, values: Tensor, loss_mask: Tensor, *, gamma: float = 1.0,
                         lam: float | Tensor = 1.0, bootstrap_values: Tensor | None = None,
                         obs_reward: str = "fold", obs_discount: str = "skip") -> tuple[Tensor, Tensor]:
    """Generalised advantage estimation over action tokens (Schulman et al. 2016, eq. 16).

    ``δ_t = r_t + γ V_{t+1} − V_t``, ``Â_t = Σ_{j≥t} (γλ)^{j−t} δ_j`` and returns
    ``Â_t + V_t``, with ``t, j`` running over action tokens only (spec "Setting").
    Bit-identical to :func:`coupled_advantage_return` with ``eta_a = 0``.

    Args:
        rewards: ``(B, T)`` float reward per token (outcome reward on the last action token;
            reward on observation tokens is folded onto the preceding action token).
        values: ``(B, T)`` float critic values V(s_t), read at action tokens only.
        loss_mask: ``(B, T)`` bool/0-1, 1 on action tokens.
        gamma: discount γ ∈ [0, 1] per action token.
        lam: GAE λ ∈ [0, 1], or a ``(B,)`` float tensor of per-row λ (:func:`per_row_lambda`).
        bootstrap_values: optional ``(B,)`` V after the last action token (truncated rows);
            default 0 (terminated).
        obs_reward: ``"fold"`` reward on observation tokens onto the preceding action token,
            or ``"error"`` to refuse it (spec "Setting", (choice)).
        obs_discount: ``"skip"`` (default): observation tokens are skipped, not discounted;
            ``"per_token"``: γ and λ apply per token position (spec "Setting", (choice)).

    Returns:
        ``(advantages, returns)``, each ``(B, T)`` with ``values.dtype``, 0 at mask-0 positions.
        Rows with no action token are all zeros.

    Raises:
        ValueError: on mismatched shapes, γ/λ outside [0, 1], a loss_mask with values other
            than 0/1, a reward that cannot be attributed to an action token, or NaN/inf in
            the inputs at action tokens (the message names the input and position).
        TypeError: on non-tensor or non-floating inputs.
    """
    mask, x = prepare_estimator_inputs(rewards, values, loss_mask, gamma, lam, bootstrap_values, obs_discount)
    if isinstance(lam, Tensor):
        return per_row_lambda(lambda v, rows: gae_advantage_return(
            rewards[rows], values[rows], loss_mask[rows], gamma=gamma, lam=v,
            bootstrap_values=_rows(bootstrap_values, rows), obs_reward=obs_reward,
            obs_discount=obs_discount), lam, mask.shape[0])
    return _td_corrected(x["rewards"], x["values"], mask, None, gamma, lam, x["bootstrap_values"],
                         obs_reward, obs_discount, {"rewards": x["rewards"], "values": x["values"]},
                         "gae_advantage_return")


def clipped_ratio(logp_old: Tensor, logp_mu: Tensor, low: float, high: float) -> Tensor:
    """Advantage-channel weight ``ρ̄ = clip(exp(logp_old − logp_mu), low, high)`` (no grad).

    Spec "Advantage channel". ``logp_mu = −inf`` gives ρ = +inf → ``high``;
    ``logp_old = −inf`` gives ρ = 0 → ``low``; both −inf give NaN.

    Args:
        logp_old: ``(B, T)`` float log π_old(y_t | s_t), recomputed by the learner.
        logp_mu: ``(B, T)`` float behavior log-probs from the rollout engine.
        low, high: the clip interval, e.g. from :func:`copc.margins`.

    Returns:
        ``(B, T)`` float tensor, detached.

    Raises:
        ValueError: if the shapes differ or ``low > high``.
    """
    if logp_old.shape != logp_mu.shape:
        raise ValueError(f"logp_old {tuple(logp_old.shape)} and logp_mu {tuple(logp_mu.shape)} differ")
    if not low <= high:
        raise ValueError(f"clip interval must have low <= high, got ({low!r}, {high!r})")
    with torch.no_grad():
        return torch.sub(logp_old, logp_mu).exp_().clamp_(low, high)


def coupled_advantage_return(rewards: Tensor, values: Tensor, logp_old: Tensor, logp_mu: Tensor,
                             loss_mask: Tensor, *, gamma: float = 1.0, lam: float | Tensor = 1.0,
                             eta_a: float = 0.5, eps_low: float = EPS_LOW,
                             eps_high: float = EPS_HIGH,
                             bootstrap_values: Tensor | None = None,
                             obs_reward: str = "fold", obs_discount: str = "skip"
                             ) -> tuple[Tensor, Tensor]:
    """COPC advantage channel: clipped-ratio TD weighting (spec, "Advantage channel").

    Over action tokens t (observation tokens skipped)::

        ρ̄_t = clip(exp(logp_old_t − logp_mu_t), ℓ_A, u_A),  (ℓ_A, u_A) = margins(eta_a, ε_ℓ, ε_h)
        δ_t = r_t + γ V_{t+1} − V_t
        G_t = ρ̄_t δ_t + γλ G_{t+1},  G_{after last} = 0
        returns_t = V_t + G_t                (critic target v̂_t)
        advantages_t = δ_t + γλ G_{t+1}      (actor advantage Â_t; own residual unweighted)

    COPC paper (Hu et al. 2026) §5; ``eta_a = 0`` is plain GAE ("COPC w/o RC") and is
    bit-identical to :func:`gae_advantage_return` (the log-probs are then not read).
    With γλ = 1 the scan is a reverse cumulative sum (no sequential loop at all).

    Args:
        rewards: ``(B, T)`` float reward per token (see :func:`gae_advantage_return`).
        values: ``(B, T)`` float critic values V(s_t), read at action tokens only.
        logp_old: ``(B, T)`` float learner log-probs before the update (no grad needed).
        logp_mu: ``(B, T)`` float behavior-policy log-probs from the rollout engine.
        loss_mask: ``(B, T)`` bool/0-1, 1 on action tokens.
        gamma, lam: γ, λ ∈ [0, 1]; ``lam`` may be a ``(B,)`` float tensor of per-row λ: each row
            then uses its own discount ``c_b = γ λ_b`` in the scan (one scan per distinct λ,
            :func:`per_row_lambda`; VAPO's length-adaptive GAE).
        eta_a: advantage-channel strength η_A ∈ [0, 1].
        eps_low, eps_high: base margins ε_ℓ, ε_h.
        bootstrap_values: optional ``(B,)`` V after the last action token (truncated rows).
        obs_reward, obs_discount: see :func:`gae_advantage_return`.

    Returns:
        ``(advantages, returns)``, each ``(B, T)``, ``values.dtype``, 0 at mask-0 positions;
        rows without action tokens are all zeros. Outputs carry no gradient history from
        the log-probs.

    Raises:
        ValueError: as :func:`gae_advantage_return`, plus NaN log-ratios at action tokens
            (e.g. ``logp_old = logp_mu = −inf``). ``logp_mu = −inf`` alone is defined: ρ̄ = u_A.
        TypeError: on non-tensor or non-floating inputs.
    """
    mask, x = prepare_estimator_inputs(rewards, values, loss_mask, gamma, lam, bootstrap_values, obs_discount,
                       logp_old=logp_old, logp_mu=logp_mu)
    if isinstance(lam, Tensor):
        return per_row_lambda(lambda v, rows: coupled_advantage_return(
            rewards[rows], values[rows], logp_old[rows], logp_mu[rows], loss_mask[rows], gamma=gamma,
            lam=v, eta_a=eta_a, eps_low=eps_low, eps_high=eps_high,
            bootstrap_values=_rows(bootstrap_values, rows), obs_reward=obs_reward,
            obs_discount=obs_discount), lam, mask.shape[0])
    low, high = margins(eta_a, eps_low, eps_high)
    rho_bar = None
    if not (low == 1.0 and high == 1.0):
        rho_bar = clipped_ratio(x["logp_old"], x["logp_mu"], low, high)
    inputs = {k: x[k] for k in ("rewards", "values", "logp_old", "logp_mu")}
    return _td_corrected(x["rewards"], x["values"], mask, rho_bar, gamma, lam, x["bootstrap_values"],
                         obs_reward, obs_discount, inputs, "coupled_advantage_return")


def vtrace_advantage_return(rewards: Tensor, values: Tensor, logp_old: Tensor, logp_mu: Tensor,
                            loss_mask: Tensor, *, gamma: float = 1.0, lam: float | Tensor = 1.0,
                            rho_clip: float = 1.0, c_clip: float = 1.0,
                            bootstrap_values: Tensor | None = None,
                            obs_reward: str = "fold") -> tuple[Tensor, Tensor]:
    """V-trace targets and policy-gradient advantages (Espeholt et al. 2018, eq. 1 and §4.2).

    Over action tokens (observation tokens skipped), with ratio ``= exp(logp_old − logp_mu)``::

        ρ_s = min(ρ̄, ratio_s),   c_s = λ · min(c̄, ratio_s)
        v_s − V_s = ρ_s δ_s + γ c_s (v_{s+1} − V_{s+1})        returns = v_s
        advantages_s = ρ_s (r_s + γ v_{s+1} − V_s)

    with ``v`` after the last action token equal to the bootstrap value (0 by default).
    Spec "Baselines", V-trace. The trace coefficient varies per token, so this runs a
    loop over the action positions (O(T) Python steps; COPC's estimator needs none).

    Args:
        rewards, values, logp_old, logp_mu, loss_mask: as :func:`coupled_advantage_return`.
        gamma, lam: γ, λ ∈ [0, 1]; ``lam`` may be a ``(B,)`` float tensor of per-row trace λ
            (``c_s = λ_b · min(c̄, ratio_s)`` in row ``b``), validated as :func:`per_row_lambda`.
        rho_clip: truncation level ρ̄ > 0 (default 1).
        c_clip: truncation level c̄ > 0 (default 1).
        bootstrap_values: optional ``(B,)`` value after the last action token.
        obs_reward: ``"fold"`` or ``"error"``, see :func:`gae_advantage_return`.

    Returns:
        ``(advantages, returns)``, each ``(B, T)``, 0 at mask-0 positions.

    Raises:
        ValueError: as :func:`coupled_advantage_return`, plus non-positive ``rho_clip``/``c_clip``.
    """
    mask, x = prepare_estimator_inputs(rewards, values, loss_mask, gamma, lam, bootstrap_values, "skip",
                       logp_old=logp_old, logp_mu=logp_mu)
    rewards, values, logp_old, logp_mu = (x[k] for k in ("rewards", "values", "logp_old", "logp_mu"))
    bootstrap_values = x["bootstrap_values"]
    for name, v in (("rho_clip", rho_clip), ("c_clip", c_clip)):
        if not check_number(name, v) > 0.0:
            raise ValueError(f"{name} must be > 0, got {v!r}")
    B, T = values.shape
    if isinstance(lam, Tensor):
        check_row_lambda(lam, B)
    dtype = values.dtype
    if T == 0:
        return torch.zeros_like(values), torch.zeros_like(values)
    starts, ends = action_block_bounds(mask)
    delta = td_residuals(rewards, values, mask, gamma, bootstrap_values, starts, ends, obs_reward)
    delta = torch.where(mask, delta, 0.0)
    with torch.no_grad():
        ratio = torch.where(mask, torch.sub(logp_old, logp_mu), 0.0).exp().to(dtype)
    rho = ratio.clamp(max=rho_clip)
    if isinstance(lam, Tensor):
        cs = lam.to(values.device, dtype).unsqueeze(1) * ratio.clamp(max=c_clip)
    else:
        cs = lam * ratio.clamp(max=c_clip)
    # diff[b, t] = v_t − V_t at action tokens, carried backwards across observation tokens.
    diff = torch.zeros(B, T + 1, dtype=dtype, device=values.device)
    for t in range(T - 1, -1, -1):
        m = mask[:, t]
        d_t = rho[:, t] * delta[:, t] + gamma * cs[:, t] * diff[:, t + 1]
        diff[:, t] = torch.where(m, d_t, diff[:, t + 1])
    # r_s + γ v_{s+1} − V_s = δ_s + γ (v_{s+1} − V_{s+1}); the correction after the last
    # action token is 0 (v there is the bootstrap value itself).
    returns = torch.where(mask, values + diff[:, :T], 0.0)
    advantages = torch.where(mask, rho * (delta + gamma * diff[:, 1:]), 0.0)
    inputs = {"rewards": (rewards, torch.ones_like(mask)), "values": values, "logp_old": logp_old,
              "logp_mu": logp_mu}
    if bootstrap_values is not None:
        inputs["bootstrap_values"] = bootstrap_values
    raise_if_not_finite((advantages, returns), inputs, mask, "vtrace_advantage_return")
    return advantages, returns
