"""Exact Propositions 2–3 and Corollary 1 of the COPC paper on a :class:`~copc.token_tree.TokenTree`.

Spec "What the paper proves" (COPC paper, Hu et al. 2026, §4). Per token t of a trajectory
``y ∼ µ`` (|y| = H), with ψ_t = ∇_θ log π_θ(y_t|s_t), ρ_t = π/µ, the DIS weight
``w_t = ρ_t·1{ℓ_P < ρ_t < u_P}`` (spec "Policy channel") and COPC's advantage Â_t computed by
the library estimator :func:`copc.coupled_advantage_return` (spec "Advantage channel"):

* update ``g(η_P, η_A) = E_µ[(1/H) Σ_t w_t ψ_t Â_t]``; reference
  ``g* = E_µ[(1/H) Σ_t ρ_t ψ_t A^π_t]`` (raw ratios, true advantages of π);
* Proposition 2: with Δ_t = w_t − ρ_t, e_t = Â_t − A^π_t,
  ``g − g* = T1 + T2 + T3 = E[(1/H) Σ ψ_t Δ_t A^π_t] + E[(1/H) Σ ψ_t ρ_t e_t] + E[(1/H) Σ ψ_t Δ_t e_t]``;
* Proposition 3: ``E[w_t² ‖ψ_t‖² σ_t²(η_A) / H²]`` with ``σ_t² = Var_µ[Â_t | s_t, y_t]``;
* Corollary 1: ``MSE(N) = ‖g − g*‖² + tr Cov_µ[ĝ(y)] / N`` for the mean of N i.i.d. trajectories.

On a tree each prefix node is visited at most once per trajectory and ψ_t lives in node s_t's
block of θ, so the per-token gradients of one trajectory are orthogonal and
``tr Cov[ĝ] = Σ_t Prop3_t + tr Cov[ḡ]`` exactly, where ḡ replaces Â_t by E[Â_t | s_t, y_t]
(law of total variance per token): here the Proposition-3 term is the *whole* advantage-noise
part of the variance.

What g* is: with per-token ratios the states are still drawn from µ, so
``H·g* = Σ_t E_{s_t∼µ} E_{a∼π}[∇log π(a|s_t) A^π(s_t, a)]``. When µ = π and γ = 1 this is the
exact policy gradient ∇_θ J(θ) (policy gradient theorem); otherwise it is the per-decision
off-policy surrogate gradient (states from µ, no γ^t state weighting).

All quantities are exact finite sums over the V^H trajectories (float64, no sampling).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from .advantages import coupled_advantage_return
from .margins import margins
from .token_tree import TokenTree, enumerate_trajectories, state_values

Tensor = torch.Tensor

#: Default (η_P, η_A) grid values.
DEFAULT_ETAS = (0.0, 0.25, 0.5, 0.75, 1.0)


@dataclass(frozen=True)
class TreeEnumeration:
    """Per-trajectory, per-token tensors of a tree that do not depend on (η_P, η_A).

    Attributes (K = V^H trajectories, H tokens each; all float64 unless stated):
        tree: the tree.
        keys: ``(K, H)`` int64 flat (state, action) index ``s_t·V + y_t``.
        prob_mu: ``(K,)`` µ-probability of each trajectory (sums to 1).
        logp_pi, logp_mu: ``(K, H)`` log π(y_t|s_t), log µ(y_t|s_t).
        rho: ``(K, H)`` ρ_t = exp(log π − log µ).
        rewards: ``(K, H)`` r(s_t, y_t).
        values: ``(K, H)`` critic V̂(s_t).
        adv_true: ``(K, H)`` A^π(s_t, y_t) = Q^π − V^π.
        psi_sq: ``(K, H)`` ‖ψ_t‖² = 1 − 2π(y_t|s_t) + Σ_a π(a|s_t)².
    """

    tree: TokenTree
    keys: Tensor
    prob_mu: Tensor
    logp_pi: Tensor
    logp_mu: Tensor
    rho: Tensor
    rewards: Tensor
    values: Tensor
    adv_true: Tensor
    psi_sq: Tensor


def enumerate_tree(tree: TokenTree) -> TreeEnumeration:
    """Enumerate all trajectories of ``tree`` with their µ-probabilities and per-token tensors.

    Args:
        tree: the token tree.

    Returns:
        :class:`TreeEnumeration`.
    """
    traj = enumerate_trajectories(tree.vocab, tree.horizon)
    pi = tree.pi()
    logp_pi = torch.log_softmax(tree.pi_logits, -1).reshape(-1)[traj.keys]
    logp_mu = torch.log_softmax(tree.mu_logits, -1).reshape(-1)[traj.keys]
    v_pi, q_pi = state_values(tree, pi)
    adv = (q_pi - v_pi[:, None]).reshape(-1)[traj.keys]
    pi_sq = (pi * pi).sum(-1)
    psi_sq = 1.0 - 2.0 * pi.reshape(-1)[traj.keys] + pi_sq[traj.nodes]
    return TreeEnumeration(
        tree=tree, keys=traj.keys, prob_mu=logp_mu.sum(1).exp(), logp_pi=logp_pi, logp_mu=logp_mu,
        rho=torch.sub(logp_pi, logp_mu).exp(), rewards=tree.rewards.reshape(-1)[traj.keys],
        values=tree.critic[traj.nodes], adv_true=adv, psi_sq=psi_sq)


def coupled_advantages(enum: TreeEnumeration, eta_a: float) -> Tensor:
    """COPC's Â_t for every trajectory, from the library estimator :func:`copc.coupled_advantage_return`.

    Args:
        enum: the enumerated tree.
        eta_a: advantage-channel strength η_A ∈ [0, 1]; ρ̄ clipped to [1 − η_A ε_ℓ, 1 + η_A ε_h].

    Returns:
        ``(K, H)`` float64 advantages.

    Raises:
        ValueError: if ``eta_a`` is outside [0, 1].
    """
    t = enum.tree
    adv, _ = coupled_advantage_return(enum.rewards, enum.values, enum.logp_pi, enum.logp_mu,
                                      torch.ones_like(enum.rewards, dtype=torch.bool), gamma=t.gamma,
                                      lam=t.lam, eta_a=eta_a, eps_low=t.eps_low, eps_high=t.eps_high)
    return adv


def dis_weights(enum: TreeEnumeration, eta_p: float) -> Tensor:
    """Policy-channel weights ``w_t = ρ_t·1{ℓ_P < ρ_t < u_P}`` (spec "Policy channel"; strict, as
    :func:`copc.dis_policy_loss`).

    Args:
        enum: the enumerated tree.
        eta_p: policy-channel strength η_P ∈ [0, 1] (η_P = 0 gives an empty interval: w ≡ 0).

    Returns:
        ``(K, H)`` float64.
    """
    low, high = margins(eta_p, enum.tree.eps_low, enum.tree.eps_high)
    keep = (enum.rho > low) & (enum.rho < high)
    return torch.where(keep, enum.rho, 0.0)


def expected_gradient(enum: TreeEnumeration, coef: Tensor) -> Tensor:
    """``E_µ[(1/H) Σ_t coef_t ψ_t]`` as an ``(N, V)`` float64 tensor (the gradient w.r.t. the logits θ).

    ψ_t = e_{y_t} − π(·|s_t) in node s_t's block, so the expectation is a scatter-add of
    ``P_µ(y)·coef_t/H`` into (s_t, y_t) minus its node total times π(·|s_t).

    Args:
        enum: the enumerated tree.
        coef: ``(K, H)`` float64 per-token scalar coefficient (e.g. ``w_t Â_t``).

    Returns:
        ``(N, V)`` float64.
    """
    t = enum.tree
    weight = (enum.prob_mu[:, None] * coef / t.horizon).reshape(-1)
    s = torch.zeros(t.n_nodes * t.vocab, dtype=torch.float64).index_add_(0, enum.keys.reshape(-1), weight)
    s = s.reshape(t.n_nodes, t.vocab)
    return s - s.sum(-1, keepdim=True) * t.pi()


def _second_moment(enum: TreeEnumeration, coef: Tensor) -> Tensor:
    """``E_µ‖(1/H) Σ_t coef_t ψ_t‖²`` (0-d): the ψ_t of one trajectory sit in disjoint blocks."""
    return (enum.prob_mu[:, None] * coef.square() * enum.psi_sq).sum() / enum.tree.horizon ** 2


def conditional_moments(enum: TreeEnumeration, x: Tensor) -> tuple[Tensor, Tensor]:
    """``E_µ[x_t | s_t, y_t]`` and ``Var_µ[x_t | s_t, y_t]`` read back at every (trajectory, token).

    Args:
        enum: the enumerated tree.
        x: ``(K, H)`` float64 per-token quantity (e.g. Â_t).

    Returns:
        ``(mean, var)``, each ``(K, H)`` float64 (the variance computed two-pass, ≥ 0).
    """
    t = enum.tree
    keys = enum.keys.reshape(-1)
    p = enum.prob_mu[:, None].expand_as(x).reshape(-1)
    size = t.n_nodes * t.vocab

    def cond_sum(v: Tensor) -> Tensor:
        return torch.zeros(size, dtype=torch.float64).index_add_(0, keys, p * v.reshape(-1))

    mass = cond_sum(torch.ones_like(x))
    safe = torch.where(mass > 0, mass, 1.0)
    mean = (cond_sum(x) / safe)[enum.keys]
    var = (cond_sum((x - mean).square()) / safe)[enum.keys]
    return mean, var


@dataclass(frozen=True)
class CouplingTerms:
    """Exact Proposition-2/3 quantities at one (η_P, η_A) (float64; gradients are w.r.t. θ = π's logits).

    Attributes:
        eta_p, eta_a: channel strengths.
        g: ``(N, V)`` two-channel update E[(1/H) Σ w ψ Â].
        g_star: ``(N, V)`` reference E[(1/H) Σ ρ ψ A^π].
        t1, t2, t3: ``(N, V)`` Proposition-2 terms (policy-weight error, advantage error,
            interaction); ``t1 + t2 + t3 = g − g*``.
        bias2: ‖g − g*‖².
        variance: tr Cov_µ[ĝ(y)] of the single-trajectory estimator ĝ(y) = (1/H) Σ w ψ Â.
        prop3_per_token: ``(H,)`` E[w_t² ‖ψ_t‖² σ_t²(η_A) / H²] per position t.
        prop3: Σ_t of ``prop3_per_token``.
        cond_mean_variance: tr Cov[ḡ], ḡ = (1/H) Σ w ψ E[Â|s, y]; ``variance = prop3 + this``.
        masked_frac: µ-expected fraction of tokens with w_t = 0 (masked by the DIS interval).
    """

    eta_p: float
    eta_a: float
    g: Tensor
    g_star: Tensor
    t1: Tensor
    t2: Tensor
    t3: Tensor
    bias2: float
    variance: float
    prop3_per_token: Tensor
    prop3: float
    cond_mean_variance: float
    masked_frac: float

    def mse(self, n: int) -> float:
        """Corollary 1: ``‖g − g*‖² + tr Cov[ĝ]/N`` for the mean of ``n ≥ 1`` i.i.d. trajectories.

        Raises:
            ValueError: if ``n`` is not a positive int.
        """
        _check_n(n)
        return self.bias2 + self.variance / n


def _check_n(n: int) -> None:
    """Raise ``ValueError`` naming ``n`` unless it is an int ≥ 1."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"n (trajectories per update) must be an int >= 1, got {n!r}")


def reference_gradient(enum: TreeEnumeration) -> Tensor:
    """g* = E_µ[(1/H) Σ_t ρ_t ψ_t A^π_t] as ``(N, V)`` float64 (what it equals: module docstring)."""
    return expected_gradient(enum, enum.rho * enum.adv_true)


def coupling_terms(tree: TokenTree | TreeEnumeration, eta_p: float, eta_a: float) -> CouplingTerms:
    """Exact g, g*, Proposition-2 terms, Proposition-3 term and total variance at (η_P, η_A).

    Args:
        tree: a :class:`TokenTree`, or its :class:`TreeEnumeration` to reuse across a grid.
        eta_p: policy-channel strength η_P ∈ [0, 1].
        eta_a: advantage-channel strength η_A ∈ [0, 1].

    Returns:
        :class:`CouplingTerms`.

    Raises:
        ValueError: if ``eta_p`` or ``eta_a`` is outside [0, 1].
    """
    enum = tree if isinstance(tree, TreeEnumeration) else enumerate_tree(tree)
    adv = coupled_advantages(enum, eta_a)
    w = dis_weights(enum, eta_p)
    delta, err = w - enum.rho, adv - enum.adv_true
    g = expected_gradient(enum, w * adv)
    g_star = reference_gradient(enum)
    t1 = expected_gradient(enum, delta * enum.adv_true)
    t2 = expected_gradient(enum, enum.rho * err)
    t3 = expected_gradient(enum, delta * err)
    H = enum.tree.horizon
    mean_adv, var_adv = conditional_moments(enum, adv)
    p = enum.prob_mu[:, None]
    prop3_tok = (p * w.square() * enum.psi_sq * var_adv).sum(0) / H ** 2
    g_sq = float(g.square().sum())
    return CouplingTerms(
        eta_p=float(eta_p), eta_a=float(eta_a), g=g, g_star=g_star, t1=t1, t2=t2, t3=t3,
        bias2=float((g - g_star).square().sum()),
        variance=float(_second_moment(enum, w * adv)) - g_sq,
        prop3_per_token=prop3_tok, prop3=float(prop3_tok.sum()),
        cond_mean_variance=float(_second_moment(enum, w * mean_adv)) - g_sq,
        masked_frac=float((p * (w == 0)).sum() / H))


#: Per-cell metrics a :class:`CouplingGrid` holds, each a ``(P, A)`` float64 tensor.
GRID_METRICS = ("bias2", "variance", "variance_over_n", "mse", "prop3", "t1_norm", "t2_norm", "t3_norm",
                "masked_frac")


@dataclass(frozen=True)
class CouplingGrid:
    """Corollary-1 quantities over an (η_P, η_A) grid (rows η_P, columns η_A).

    Attributes:
        eta_p, eta_a: the grid values.
        n: trajectories per update N in ``MSE = bias² + variance/N``.
        g_star_norm: ‖g*‖ (the same in every cell).
        metrics: name → ``(P, A)`` float64 tensor for every name in :data:`GRID_METRICS`
            (``t*_norm`` are Euclidean norms of the Proposition-2 terms).
    """

    eta_p: tuple[float, ...]
    eta_a: tuple[float, ...]
    n: int
    g_star_norm: float
    metrics: dict[str, Tensor] = field(default_factory=dict)

    def __getitem__(self, name: str) -> Tensor:
        """The ``(P, A)`` tensor of metric ``name``; ``KeyError`` names the valid ones."""
        if name not in self.metrics:
            raise KeyError(f"unknown grid metric {name!r}; valid: {sorted(self.metrics)}")
        return self.metrics[name]

    def to_dict(self) -> dict[str, object]:
        """JSON-ready dict: the axes, ``n``, ``g_star_norm`` and each metric as nested lists (rows η_P)."""
        return {"eta_p": list(self.eta_p), "eta_a": list(self.eta_a), "n": self.n,
                "g_star_norm": self.g_star_norm,
                **{k: v.tolist() for k, v in self.metrics.items()}}


def _check_etas(name: str, values: Sequence[float]) -> tuple[float, ...]:
    """Validate a non-empty, duplicate-free sequence of η ∈ [0, 1]; return it as floats."""
    vals = tuple(float(v) for v in values)
    if not vals:
        raise ValueError(f"{name} must not be empty")
    if len(set(vals)) != len(vals):
        raise ValueError(f"{name} has duplicate values: {vals}")
    for v in vals:
        if not 0.0 <= v <= 1.0:
            raise ValueError(f"{name} values must be in [0, 1], got {v!r}")
    return vals


def coupling_grid(tree: TokenTree, eta_p: Sequence[float] = DEFAULT_ETAS,
                  eta_a: Sequence[float] = DEFAULT_ETAS, n: int = 1) -> CouplingGrid:
    """Evaluate :func:`coupling_terms` on every (η_P, η_A) cell (Corollary 1 over a grid).

    Args:
        tree: the token tree.
        eta_p, eta_a: grid values in [0, 1] (default {0, 0.25, 0.5, 0.75, 1}).
        n: trajectories per update N ≥ 1.

    Returns:
        :class:`CouplingGrid`.

    Raises:
        ValueError: on an empty grid, a duplicate or out-of-range η, or a bad ``n``.
    """
    ps, as_ = _check_etas("eta_p", eta_p), _check_etas("eta_a", eta_a)
    _check_n(n)
    enum = enumerate_tree(tree)
    out = {k: torch.zeros(len(ps), len(as_), dtype=torch.float64) for k in GRID_METRICS}
    g_star_norm = float(reference_gradient(enum).norm())
    for i, ep in enumerate(ps):
        for j, ea in enumerate(as_):
            c = coupling_terms(enum, ep, ea)
            cell = {"bias2": c.bias2, "variance": c.variance, "variance_over_n": c.variance / n,
                    "mse": c.mse(n), "prop3": c.prop3, "t1_norm": float(c.t1.norm()),
                    "t2_norm": float(c.t2.norm()), "t3_norm": float(c.t3.norm()),
                    "masked_frac": c.masked_frac}
            for k, v in cell.items():
                out[k][i, j] = v
    return CouplingGrid(ps, as_, n, g_star_norm, out)


@dataclass(frozen=True)
class Reversal:
    """The effect of weakening the advantage correction (η_A: low → high) at two policy strengths.

    Attributes:
        metric: grid metric compared (lower is better, e.g. ``"mse"``).
        strong_p, weak_p: the strong (smaller) and weak (larger) η_P.
        eta_a_low, eta_a_high: the two η_A values.
        effect_strong: metric(strong_p, η_A high) − metric(strong_p, η_A low).
        effect_weak: the same at ``weak_p``.
        reversal: the two effects have opposite signs (each beyond the tolerance).
        paper_direction: reversal as in the paper's Figure 1: weakening A helps under strong
            P (effect_strong < 0) and hurts under weak P (effect_weak > 0).
    """

    metric: str
    strong_p: float
    weak_p: float
    eta_a_low: float
    eta_a_high: float
    effect_strong: float
    effect_weak: float
    reversal: bool
    paper_direction: bool


def _index(name: str, values: tuple[float, ...], v: float) -> int:
    """Index of ``v`` in the grid axis ``values``; ``ValueError`` if it is not a grid value."""
    for i, x in enumerate(values):
        if math.isclose(x, v, abs_tol=1e-12):
            return i
    raise ValueError(f"{name} = {v!r} is not on the grid axis {values}")


def coordination_reversal(grid: CouplingGrid, metric: str = "mse", strong_p: float = 0.25,
                          weak_p: float = 0.75, eta_a_low: float = 0.25, eta_a_high: float = 0.75,
                          rel_tol: float = 1e-9) -> Reversal:
    """Does the sign of weakening the advantage correction depend on the policy correction?

    The paper's coordination hypothesis (spec "What the paper proves", Figure 1): at η_P = 0.25,
    raising η_A from 0.25 to 0.75 helps; at η_P = 0.75 the same move hurts. Here "helps" means
    the exact ``metric`` (lower is better) goes down.

    Args:
        grid: a :class:`CouplingGrid` containing the four cells.
        metric: one of :data:`GRID_METRICS` (default ``"mse"``).
        strong_p, weak_p: η_P values with ``strong_p < weak_p``.
        eta_a_low, eta_a_high: η_A values with ``eta_a_low < eta_a_high``.
        rel_tol: an effect counts only if ``|effect| > rel_tol·max(|cell values|)``.

    Returns:
        :class:`Reversal`.

    Raises:
        ValueError: if a value is not on the grid or the pairs are not ordered.
        KeyError: for an unknown metric.
    """
    if not (strong_p < weak_p and eta_a_low < eta_a_high):
        raise ValueError(f"need strong_p < weak_p and eta_a_low < eta_a_high, got "
                         f"({strong_p}, {weak_p}) and ({eta_a_low}, {eta_a_high})")
    m = grid[metric]
    i_s, i_w = _index("strong_p", grid.eta_p, strong_p), _index("weak_p", grid.eta_p, weak_p)
    j_lo, j_hi = _index("eta_a_low", grid.eta_a, eta_a_low), _index("eta_a_high", grid.eta_a, eta_a_high)
    d_s = float(m[i_s, j_hi] - m[i_s, j_lo])
    d_w = float(m[i_w, j_hi] - m[i_w, j_lo])
    tol = rel_tol * float(m[[i_s, i_s, i_w, i_w], [j_lo, j_hi, j_lo, j_hi]].abs().max())
    sig_s = 0 if abs(d_s) <= tol else (1 if d_s > 0 else -1)
    sig_w = 0 if abs(d_w) <= tol else (1 if d_w > 0 else -1)
    return Reversal(metric, float(strong_p), float(weak_p), float(eta_a_low), float(eta_a_high), d_s, d_w,
                    reversal=sig_s * sig_w < 0, paper_direction=sig_s < 0 < sig_w)


def find_reversals(grid: CouplingGrid, metric: str = "mse", rel_tol: float = 1e-9) -> list[Reversal]:
    """Every reversal on the grid: all η_P pairs × all η_A pairs (ordered) whose effects change sign.

    Args:
        grid, metric, rel_tol: as :func:`coordination_reversal`.

    Returns:
        The :class:`Reversal` records with ``reversal`` true (possibly empty).
    """
    found = []
    ps, as_ = sorted(grid.eta_p), sorted(grid.eta_a)
    for i, p_lo in enumerate(ps):
        for p_hi in ps[i + 1:]:
            for j, a_lo in enumerate(as_):
                for a_hi in as_[j + 1:]:
                    r = coordination_reversal(grid, metric, p_lo, p_hi, a_lo, a_hi, rel_tol)
                    if r.reversal:
                        found.append(r)
    return found
