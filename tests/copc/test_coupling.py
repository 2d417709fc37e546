"""Propositions 2–3 and Corollary 1 (spec "What the paper proves") on exact token trees.

The references here are independent of :mod:`copc.coupling`: explicit Python loops over the
trajectories, ψ from autograd of ``log_softmax``, Â from a hand-written per-token recursion,
and the policy gradient from autograd of the enumerated objective J(θ).
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch

import copc
from copc.coupling import (
    CouplingGrid,
    coordination_reversal,
    coupling_grid,
    coupling_terms,
    enumerate_tree,
    find_reversals,
)
from copc.token_tree import TokenTree, enumerate_trajectories, policy_objective, state_values

F64 = torch.float64


def _tree(seed: int, vocab: int = 3, horizon: int = 3, **kw) -> TokenTree:
    return TokenTree.random(vocab, horizon, generator=torch.Generator().manual_seed(seed), **kw)


def _on_policy(tree: TokenTree) -> TokenTree:
    return tree.replace(mu_logits=tree.pi_logits.clone())


def _perfect_critic(tree: TokenTree) -> TokenTree:
    return tree.replace(critic=state_values(tree, tree.pi())[0])


# ----------------------------------------------------------------------------- Proposition 2


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize(("eta_p", "eta_a"), [(0.25, 0.75), (0.5, 0.5), (1.0, 0.0), (0.75, 1.0)])
def test_three_terms_sum_to_bias(seed, eta_p, eta_a):
    tree = _tree(seed, gamma=0.9, lam=0.8, staleness_scale=0.6, critic_noise=0.3, token_reward_scale=0.5)
    c = coupling_terms(tree, eta_p, eta_a)
    torch.testing.assert_close(c.t1 + c.t2 + c.t3, c.g - c.g_star, atol=1e-10, rtol=0)
    assert c.bias2 == pytest.approx(float((c.t1 + c.t2 + c.t3).square().sum()), abs=1e-12)
    # every term is really present: none of them is identically zero on a stale, noisy tree
    assert min(float(c.t1.norm()), float(c.t2.norm()), float(c.t3.norm())) > 1e-4


def test_on_policy_full_interval_leaves_only_the_critic_error_term():
    tree = _on_policy(_tree(1, gamma=1.0, lam=0.5, critic_noise=0.4))
    c = coupling_terms(tree, eta_p=1.0, eta_a=0.0)
    assert float(c.t1.abs().max()) == 0.0 and float(c.t3.abs().max()) == 0.0  # ρ = 1 ⇒ Δ = 0
    torch.testing.assert_close(c.g - c.g_star, c.t2, atol=1e-12, rtol=0)
    assert float(c.t2.norm()) > 1e-3  # λ < 1 with a noisy critic: a real advantage bias
    # with γ = λ = 1 the critic error is a pure state baseline: E[ψ e] = 0
    c1 = coupling_terms(tree.replace(lam=1.0), eta_p=1.0, eta_a=0.0)
    torch.testing.assert_close(c1.g, c1.g_star, atol=1e-12, rtol=0)


@pytest.mark.parametrize("eta_a", [0.0, 0.5, 1.0])
def test_on_policy_perfect_critic_gives_g_star(eta_a):
    tree = _perfect_critic(_on_policy(_tree(2, horizon=4, critic_noise=0.0, token_reward_scale=0.3)))
    c = coupling_terms(tree, eta_p=0.5, eta_a=eta_a)
    torch.testing.assert_close(c.g, c.g_star, atol=1e-12, rtol=0)
    assert c.bias2 < 1e-24 and float(c.g_star.norm()) > 1e-2


def test_eta_p_zero_masks_everything():
    c = coupling_terms(_tree(3), eta_p=0.0, eta_a=0.5)
    assert float(c.g.abs().max()) == 0.0 and c.masked_frac == 1.0 and c.variance == 0.0
    assert c.bias2 == pytest.approx(float(c.g_star.square().sum()), rel=1e-12)


# ------------------------------------------------------------------- what g and g* are


@pytest.mark.parametrize("seed", range(3))
def test_g_star_is_the_policy_gradient_over_horizon_on_policy_undiscounted(seed):
    tree = _on_policy(_tree(seed, vocab=3, horizon=4, token_reward_scale=0.5))
    theta = tree.pi_logits.clone().requires_grad_(True)
    (grad_j,) = torch.autograd.grad(policy_objective(tree, theta), theta)
    g_star = coupling_terms(tree, 0.5, 0.5).g_star
    torch.testing.assert_close(g_star, grad_j / tree.horizon, atol=1e-12, rtol=0)
    # V^π(root) from backward induction is the enumerated J(θ)
    j = float(policy_objective(tree, theta.detach()))
    assert float(state_values(tree, tree.pi())[0][0]) == pytest.approx(j, rel=1e-12)


def test_g_star_off_policy_is_the_per_decision_surrogate_gradient():
    """µ ≠ π, γ < 1: H·g* = ∇_θ' E_µ[Σ_t π_θ'(y_t|s_t)/µ(y_t|s_t) · A^π(s_t, y_t)] at θ' = θ."""
    tree = _tree(5, gamma=0.8, staleness_scale=0.7, token_reward_scale=0.4)
    traj = enumerate_trajectories(tree.vocab, tree.horizon)
    mu = tree.mu().reshape(-1)[traj.keys]
    v, q = state_values(tree, tree.pi())
    adv = (q - v[:, None]).reshape(-1)[traj.keys]
    theta = tree.pi_logits.clone().requires_grad_(True)
    pi = torch.softmax(theta, -1).reshape(-1)[traj.keys]
    surrogate = (mu.prod(1) * (pi / mu * adv).sum(1)).sum()
    (grad,) = torch.autograd.grad(surrogate, theta)
    torch.testing.assert_close(coupling_terms(tree, 0.5, 0.5).g_star, grad / tree.horizon, atol=1e-12,
                               rtol=0)
    # and it is not the gradient of J here (stale states, no γ^t weighting)
    theta2 = tree.pi_logits.clone().requires_grad_(True)
    (grad_j,) = torch.autograd.grad(policy_objective(tree, theta2), theta2)
    assert float((grad - grad_j).norm()) > 1e-3


@pytest.mark.parametrize(("eta_p", "eta_a"), [(0.25, 0.75), (0.5, 0.5), (1.0, 0.25)])
def test_g_is_minus_the_gradient_of_the_library_dis_loss(eta_p, eta_a):
    """g = −∇_θ of copc.dis_policy_loss over all trajectories weighted by K·P_µ(y)."""
    tree = _tree(7, gamma=0.95, lam=0.9, staleness_scale=0.5, critic_noise=0.2)
    enum = enumerate_tree(tree)
    adv = copc.coupled_advantage_return(enum.rewards, enum.values, enum.logp_pi, enum.logp_mu,
                                        torch.ones_like(enum.rewards), gamma=tree.gamma, lam=tree.lam,
                                        eta_a=eta_a)[0]
    theta = tree.pi_logits.clone().requires_grad_(True)
    logp = torch.log_softmax(theta, -1).reshape(-1)[enum.keys]
    K = tree.n_trajectories
    loss, _ = copc.dis_policy_loss(logp, enum.logp_mu, adv * K * enum.prob_mu[:, None],
                                   torch.ones_like(logp), eta_p=eta_p)
    (grad,) = torch.autograd.grad(loss, theta)
    torch.testing.assert_close(coupling_terms(tree, eta_p, eta_a).g, -grad, atol=1e-12, rtol=0)


# ------------------------------------------------- brute-force reference on a tiny tree


def _copc_advantage_loop(r, v, rho_bar, gamma, lam):
    """Â_t = δ_t + Σ_{j>t} (γλ)^{j−t} ρ̄_j δ_j (spec "Advantage channel"), V after the end = 0."""
    H = len(r)
    delta = [r[t] + gamma * (v[t + 1] if t + 1 < H else 0.0) - v[t] for t in range(H)]
    return [delta[t] + sum((gamma * lam) ** (j - t) * rho_bar[j] * delta[j] for j in range(t + 1, H))
            for t in range(H)]


def _brute_force(tree: TokenTree, eta_p: float, eta_a: float):
    """Explicit loops: per-trajectory full gradient vectors ĝ(y), g, g*, tr Cov, Prop-3 term."""
    V, H = tree.vocab, tree.horizon
    off = [sum(V ** i for i in range(h)) for h in range(H + 1)]
    pi, mu = tree.pi(), tree.mu()
    v_pi, q_pi = state_values(tree, pi)
    lo_p, hi_p = copc.margins(eta_p, tree.eps_low, tree.eps_high)
    lo_a, hi_a = copc.margins(eta_a, tree.eps_low, tree.eps_high)
    rows = []
    for ys in itertools.product(range(V), repeat=H):
        nodes = [off[t] + sum(ys[i] * V ** (t - 1 - i) for i in range(t)) for t in range(H)]
        prob = math.prod(float(mu[s, y]) for s, y in zip(nodes, ys, strict=True))
        rho = [float(pi[s, y] / mu[s, y]) for s, y in zip(nodes, ys, strict=True)]
        r = [float(tree.rewards[s, y]) for s, y in zip(nodes, ys, strict=True)]
        vh = [float(tree.critic[s]) for s in nodes]
        adv = _copc_advantage_loop(r, vh, [min(max(x, lo_a), hi_a) for x in rho], tree.gamma, tree.lam)
        ghat = torch.zeros(tree.n_nodes, V, dtype=F64)
        gstar = torch.zeros(tree.n_nodes, V, dtype=F64)
        toks = []
        for t, (s, y) in enumerate(zip(nodes, ys, strict=True)):
            theta = tree.pi_logits.clone().requires_grad_(True)
            (psi,) = torch.autograd.grad(torch.log_softmax(theta, -1)[s, y], theta)
            w = rho[t] if lo_p < rho[t] < hi_p else 0.0
            ghat += w * adv[t] * psi / H
            gstar += rho[t] * float(q_pi[s, y] - v_pi[s]) * psi / H
            toks.append(((s, y), w, float(psi.square().sum()), adv[t]))
        rows.append((prob, ghat, gstar, toks))
    g = sum(p * gh for p, gh, _, _ in rows)
    g_star = sum(p * gs for p, _, gs, _ in rows)
    var = sum(p * float((gh - g).square().sum()) for p, gh, _, _ in rows)
    # σ²(s, y) = Var_µ[Â_t | s_t = s, y_t = y] from explicit conditional sums
    mass, m1 = {}, {}
    for p, _, _, toks in rows:
        for key, _, _, a in toks:
            mass[key] = mass.get(key, 0.0) + p
            m1[key] = m1.get(key, 0.0) + p * a
    mean = {k: m1[k] / mass[k] for k in mass}
    var_c = {}
    for p, _, _, toks in rows:
        for key, _, _, a in toks:
            var_c[key] = var_c.get(key, 0.0) + p * (a - mean[key]) ** 2 / mass[key]
    prop3 = sum(p * w * w * psq * var_c[key] / H ** 2 for p, _, _, toks in rows for key, w, psq, _ in toks)
    return rows, g, g_star, var, prop3


@pytest.mark.parametrize(("eta_p", "eta_a", "gamma", "lam"),
                         [(0.5, 0.5, 1.0, 1.0), (0.25, 1.0, 0.9, 0.7), (1.0, 0.25, 1.0, 0.5)])
def test_exact_values_match_brute_force_loop_on_v2_h3(eta_p, eta_a, gamma, lam):
    tree = _tree(11, vocab=2, horizon=3, gamma=gamma, lam=lam, staleness_scale=0.5, critic_noise=0.3,
                 token_reward_scale=0.5)
    rows, g, g_star, var, prop3 = _brute_force(tree, eta_p, eta_a)
    c = coupling_terms(tree, eta_p, eta_a)
    torch.testing.assert_close(c.g, g, atol=1e-12, rtol=0)
    torch.testing.assert_close(c.g_star, g_star, atol=1e-12, rtol=0)
    assert c.variance == pytest.approx(var, abs=1e-12) and var > 1e-3
    assert c.prop3 == pytest.approx(prop3, abs=1e-12) and prop3 > 1e-4
    # Corollary 1 for N = 1 and N = 2 (all ordered pairs of i.i.d. trajectories)
    mse1 = sum(p * float((gh - g_star).square().sum()) for p, gh, _, _ in rows)
    mse2 = sum(p1 * p2 * float(((gh1 + gh2) / 2 - g_star).square().sum())
               for (p1, gh1, _, _), (p2, gh2, _, _) in itertools.product(rows, rows))
    assert c.mse(1) == pytest.approx(mse1, abs=1e-12)
    assert c.mse(2) == pytest.approx(mse2, abs=1e-12)


# ------------------------------------------------------------------------- Proposition 3


@pytest.mark.parametrize("seed", range(3))
def test_prop3_is_the_advantage_noise_part_of_the_variance(seed):
    tree = _tree(seed, gamma=0.9, lam=0.9, staleness_scale=0.8, critic_noise=0.3)
    for eta_p, eta_a in [(0.25, 0.25), (0.5, 0.75), (1.0, 1.0)]:
        c = coupling_terms(tree, eta_p, eta_a)
        assert 0.0 < c.prop3 <= c.variance
        assert c.variance == pytest.approx(c.prop3 + c.cond_mean_variance, abs=1e-12)
        assert c.cond_mean_variance >= -1e-15
        assert c.prop3_per_token.shape == (tree.horizon,)
        assert float(c.prop3_per_token[-1]) == pytest.approx(0.0, abs=1e-15)  # Â_{H−1} = δ_{H−1} is fixed


def test_prop3_is_zero_with_deterministic_advantages():
    """λ = 0 ⇒ Â_t = δ_t depends on (s_t, y_t) only ⇒ σ_t² = 0 and Var = tr Cov[ḡ]."""
    c = coupling_terms(_tree(4, lam=0.0, critic_noise=0.2), 0.75, 0.5)
    assert abs(c.prop3) < 1e-15 and c.variance == pytest.approx(c.cond_mean_variance, abs=1e-15)


def test_mse_is_bias_plus_variance_over_n_on_the_grid():
    grid = coupling_grid(_tree(6), eta_p=(0.25, 0.75), eta_a=(0.0, 0.5, 1.0), n=8)
    torch.testing.assert_close(grid["mse"], grid["bias2"] + grid["variance"] / 8, atol=1e-15, rtol=0)
    torch.testing.assert_close(grid["variance_over_n"], grid["variance"] / 8, atol=1e-15, rtol=0)
    c = coupling_terms(_tree(6), 0.75, 0.5)
    assert float(grid["mse"][1, 1]) == pytest.approx(c.bias2 + c.variance / 8, abs=1e-15)
    assert grid.to_dict()["mse"][1][1] == float(grid["mse"][1, 1])


# --------------------------------------------------------------------- coordination reversal


def _grid(mse):
    m = torch.tensor(mse, dtype=F64)
    return CouplingGrid((0.25, 0.75), (0.25, 0.75), 1, 1.0, {"mse": m})


def test_reversal_hand_made_grids():
    r = coordination_reversal(_grid([[3.0, 2.0], [1.0, 1.5]]))
    assert (r.effect_strong, r.effect_weak, r.reversal, r.paper_direction) == (-1.0, 0.5, True, True)
    r = coordination_reversal(_grid([[2.0, 3.0], [1.5, 1.0]]))
    assert r.reversal and not r.paper_direction
    r = coordination_reversal(_grid([[3.0, 2.0], [2.0, 1.0]]))
    assert not r.reversal and not r.paper_direction
    r = coordination_reversal(_grid([[3.0, 3.0], [2.0, 1.0]]))  # no effect at strong η_P: no reversal
    assert not r.reversal
    assert len(find_reversals(_grid([[3.0, 2.0], [1.0, 1.5]]))) == 1


def test_reversal_rejects_values_not_on_the_grid():
    with pytest.raises(ValueError, match=r"strong_p = 0\.5"):
        coordination_reversal(_grid([[1.0, 1.0], [1.0, 1.0]]), strong_p=0.5)
    with pytest.raises(ValueError, match="strong_p < weak_p"):
        coordination_reversal(_grid([[1.0, 1.0], [1.0, 1.0]]), strong_p=0.75, weak_p=0.25)
    with pytest.raises(KeyError, match="bias2"):
        coordination_reversal(_grid([[1.0, 1.0], [1.0, 1.0]]), metric="bias2")


# ------------------------------------------------------------------------------ validation


def test_bad_inputs_name_the_field():
    g = torch.Generator().manual_seed(0)
    with pytest.raises(ValueError, match="vocab"):
        TokenTree.random(1, 3, generator=g)
    with pytest.raises(ValueError, match="MAX_TRAJECTORIES"):
        TokenTree.random(10, 6, generator=g)
    with pytest.raises(ValueError, match="staleness_scale"):
        TokenTree.random(2, 2, generator=g, staleness_scale=-1.0)
    tree = _tree(0, vocab=2, horizon=2)
    with pytest.raises(ValueError, match="critic"):
        tree.replace(critic=torch.zeros(2, dtype=F64))
    with pytest.raises(TypeError, match="pi_logits must be float64"):
        tree.replace(pi_logits=tree.pi_logits.float())
    with pytest.raises(ValueError, match="mu_logits must be finite"):
        tree.replace(mu_logits=torch.full_like(tree.mu_logits, float("nan")))
    with pytest.raises(ValueError, match="gamma"):
        tree.replace(gamma=1.5)
    with pytest.raises(ValueError, match="eta"):
        coupling_terms(tree, 1.5, 0.5)
    with pytest.raises(ValueError, match="eta_a values"):
        coupling_grid(tree, eta_a=(0.5, 2.0))
    with pytest.raises(ValueError, match="n "):
        coupling_grid(tree, n=0)


def test_enumeration_order_and_probabilities():
    traj = enumerate_trajectories(2, 3)
    assert traj.tokens[5].tolist() == [1, 0, 1]
    assert traj.nodes[5].tolist() == [0, 2, 1 + 2 + 2]  # root, prefix (1,), prefix (1, 0)
    enum = enumerate_tree(_tree(0, vocab=3, horizon=4))
    assert float(enum.prob_mu.sum()) == pytest.approx(1.0, abs=1e-14)
