"""π-referenced value probes (copc.value_probes) on exact token trees where V^π and V^µ are known:
a perfect V^π critic reads a policy–value gap of 0 (exactly, when the batch is the whole tree
drawn uniformly; up to sampling error with episodes drawn from µ), where the µ-referenced value
bias reads V^π − V^µ; b̂ estimates V^π − V^µ; invariances and bad input."""

from __future__ import annotations

import pytest
import torch

from copc.metrics import value_bias_metrics
from copc.token_tree import TokenTree, enumerate_trajectories, state_values
from copc.value_probes import policy_value_by_staleness, policy_value_metrics

F64 = torch.float64


def _tree(seed=0, staleness=1.0):
    return TokenTree.random(3, 3, generator=torch.Generator().manual_seed(seed), staleness_scale=staleness,
                            token_reward_scale=0.3)


def _batch(tree, rows, critic):
    """``(values, rewards, logp_pi, logp_mu, mask)`` of the trajectories ``rows`` (indices into the
    enumeration), each a row of H action tokens; values from ``critic`` (``(N,)`` per prefix)."""
    tr = enumerate_trajectories(tree.vocab, tree.horizon)
    nodes, toks = tr.nodes[rows], tr.tokens[rows]
    rewards = tree.rewards[nodes, toks]
    logp_pi = tree.pi().log()[nodes, toks]
    logp_mu = tree.mu().log()[nodes, toks]
    return critic[nodes], rewards, logp_pi, logp_mu, torch.ones_like(rewards, dtype=torch.bool)


def test_a_perfect_pi_critic_reads_zero_gap_exactly_on_the_whole_tree():
    """Rows = every trajectory once (a uniform behaviour u): with logp_mu = log u the weights are
    π(y)/u(y), so Ê_π[R] = Σ π(y) R(y) = V^π(root) exactly, and the gap of V^π is 0."""
    tree = _tree()
    v_pi, _ = state_values(tree, tree.pi())
    K = tree.vocab ** tree.horizon
    values, rewards, logp_pi, _, mask = _batch(tree, torch.arange(K), v_pi)
    logp_u = torch.full_like(logp_pi, -torch.log(torch.tensor(float(tree.vocab), dtype=F64)))
    m = policy_value_metrics(values, rewards, logp_pi, logp_u, mask, tree.gamma, weight_cap=1e9)
    assert m["value/policy_value_gap"] == pytest.approx(0.0, abs=1e-12)
    e_u = float(rewards.sum(1).mean())  # the uniform policy's mean return
    assert m["value/b_hat"] == pytest.approx(float(v_pi[0]) - e_u, abs=1e-12)
    assert m["value/seq_weight_capped_frac"] == 0.0


def test_with_episodes_from_mu_the_pi_probe_reads_zero_and_the_mu_probe_reads_the_staleness_gap():
    tree = _tree(seed=1, staleness=1.5)  # V^π − V^µ = −0.242 at the root
    v_pi, _ = state_values(tree, tree.pi())
    v_mu, _ = state_values(tree, tree.mu())
    K = tree.vocab ** tree.horizon
    tr = enumerate_trajectories(tree.vocab, tree.horizon)
    p_mu = tree.mu()[tr.nodes, tr.tokens].prod(1)  # µ(y) of every trajectory
    rows = torch.multinomial(p_mu, 200_000, replacement=True, generator=torch.Generator().manual_seed(0))
    values, rewards, logp_pi, logp_mu, mask = _batch(tree, rows, v_pi)
    gap_true = float(v_pi[0] - v_mu[0])
    assert abs(gap_true) > 0.05  # the tree is stale enough for the two references to differ
    m = policy_value_metrics(values, rewards, logp_pi, logp_mu, mask, tree.gamma, weight_cap=1e9)
    # importance sampling at this staleness rests on ~ESS of the 200k episodes: error ~ 1/sqrt(ESS)
    tol = 4 / (m["value/seq_weight_ess_frac"] * 200_000) ** 0.5
    assert m["value/policy_value_gap"] < tol < 0.05 * abs(gap_true) * 10
    assert m["value/b_hat"] == pytest.approx(gap_true, abs=tol)
    bias = value_bias_metrics(values, rewards, mask, tree.gamma)["critic/value_bias"]
    assert bias == pytest.approx(gap_true, abs=0.01)  # V^π − V^µ, not 0: the µ-referenced probe
    # a V^µ critic: the π probe reads |V^µ − V^π|
    m_mu = policy_value_metrics(v_mu[tr.nodes[rows]], rewards, logp_pi, logp_mu, mask, tree.gamma,
                                weight_cap=1e9)
    assert m_mu["value/policy_value_gap"] == pytest.approx(abs(gap_true), abs=tol)
    assert K == 27


def test_on_policy_weights_are_one_and_b_hat_is_zero():
    tree = _tree(seed=1)
    v_pi, _ = state_values(tree, tree.pi())
    values, rewards, logp_pi, _, mask = _batch(tree, torch.arange(27), v_pi)
    m = policy_value_metrics(values, rewards, logp_pi, logp_pi, mask, tree.gamma)
    assert m["value/b_hat"] == 0.0 and m["value/seq_weight_ess_frac"] == pytest.approx(1.0)


def test_the_cap_bites_and_is_counted():
    tree = _tree(seed=2, staleness=3.0)
    v_pi, _ = state_values(tree, tree.pi())
    values, rewards, logp_pi, logp_mu, mask = _batch(tree, torch.arange(27), v_pi)
    log_w = (logp_pi - logp_mu).sum(1)
    m = policy_value_metrics(values, rewards, logp_pi, logp_mu, mask, tree.gamma, weight_cap=1.0)
    assert m["value/seq_weight_capped_frac"] == pytest.approx(float((log_w > 0).double().mean()))
    assert 0 < m["value/seq_weight_capped_frac"] < 1


def test_garbage_at_masked_positions_changes_nothing_and_levels_split_by_oldest_token():
    g = torch.Generator().manual_seed(4)
    B, T = 6, 9
    mask = torch.rand(B, T, generator=g) > 0.3
    mask[:, 0] = True
    values, rewards = torch.randn(B, T, generator=g, dtype=F64), torch.randn(B, T, generator=g, dtype=F64)
    rewards = torch.where(mask, rewards, 0.0)
    lo = -torch.rand(B, T, generator=g, dtype=F64)
    lm = lo + 0.3 * torch.randn(B, T, generator=g, dtype=F64)
    versions = torch.tensor([[5] * T, [5] * T, [4] * T, [4] * T, [3] * T, [3] * T])
    versions[2, 5] = 3  # row 2's oldest action token (if it is one) decides its level
    mask[2, 5] = True
    a = policy_value_by_staleness(values, rewards, lo, lm, versions, 5, mask, 1.0)
    dirty = [torch.where(mask, t, torch.full_like(t, float("nan"))) for t in (values, lo, lm)]
    vers_dirty = torch.where(mask, versions, 0)
    b = policy_value_by_staleness(dirty[0], rewards, dirty[1], dirty[2], vers_dirty, 5, mask, 1.0)
    assert a == b
    levels = {k for k in a if k.startswith("value/b_hat")}
    assert levels == {"value/b_hat", "value/b_hat_s0", "value/b_hat_s1", "value/b_hat_s2"}
    alone = policy_value_metrics(values[[2, 4, 5]], rewards[[2, 4, 5]], lo[[2, 4, 5]], lm[[2, 4, 5]],
                                 mask[[2, 4, 5]], 1.0)
    assert a["value/b_hat_s2"] == alone["value/b_hat"]


def test_bad_input_is_one_line():
    z = torch.zeros(2, 3, dtype=F64)
    with pytest.raises(ValueError, match="weight_cap must be > 0"):
        policy_value_metrics(z, z, z, z, torch.ones(2, 3, dtype=torch.bool), 1.0, weight_cap=0)
    with pytest.raises(ValueError, match="gamma must be in"):
        policy_value_metrics(z, z, z, z, torch.ones(2, 3, dtype=torch.bool), 2.0)
    assert policy_value_metrics(z, z, z, z, torch.zeros(2, 3, dtype=torch.bool), 1.0) == {}
