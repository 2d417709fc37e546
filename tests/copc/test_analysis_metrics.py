"""Proposition 1 on a tabular MDP, and the metrics every trainer logs."""

from __future__ import annotations

import math

import pytest
import torch

import copc


def _policy(g: torch.Generator, S: int, A: int) -> torch.Tensor:
    x = torch.rand(S, A, generator=g, dtype=torch.float64) + 0.05
    return x / x.sum(1, keepdim=True)


def _iterate(mdp, mu, pi, low, high, lam, iters=5000):
    V = torch.zeros(mdp.rewards.shape[0], dtype=torch.float64)
    for _ in range(iters):
        V_new = copc.corrected_return_operator(mdp, V, mu, pi, low, high, lam)
        if (V_new - V).abs().max() < 1e-14:
            return V_new
        V = V_new
    raise AssertionError("operator iteration did not converge")


@pytest.mark.parametrize("lam", [1.0, 0.9, 0.5])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_proposition_1_fixed_point_is_value_of_clipped_target_policy(lam, seed):
    g = torch.Generator().manual_seed(seed)
    mdp = copc.TabularMDP.random(7, 3, 0.9, g)
    mu, pi = _policy(g, 7, 3), _policy(g, 7, 3)
    low, high = copc.margins(0.5)
    ratio = pi / mu
    assert ((ratio < low) | (ratio > high)).any(), "the clip must be active for the test to mean anything"
    V = _iterate(mdp, mu, pi, low, high, lam)
    V_tilde = copc.solve_value(mdp, copc.target_policy(mu, pi, low, high))
    torch.testing.assert_close(V, V_tilde, atol=1e-8, rtol=0)
    # and it is neither V^µ nor V^π
    assert (V - copc.solve_value(mdp, mu)).abs().max() > 1e-3
    assert (V - copc.solve_value(mdp, pi)).abs().max() > 1e-3


def test_proposition_1_limits():
    g = torch.Generator().manual_seed(5)
    mdp = copc.TabularMDP.random(5, 4, 0.8, g)
    mu, pi = _policy(g, 5, 4), _policy(g, 5, 4)
    # ρ̄ ≡ 1 → V^µ; unclipped → V^π
    torch.testing.assert_close(_iterate(mdp, mu, pi, 1.0, 1.0, 1.0), copc.solve_value(mdp, mu),
                               atol=1e-8, rtol=0)
    torch.testing.assert_close(_iterate(mdp, mu, pi, 0.0, math.inf, 1.0), copc.solve_value(mdp, pi),
                               atol=1e-8, rtol=0)


def test_tabular_mdp_validation():
    with pytest.raises(ValueError, match="must sum to 1"):
        copc.TabularMDP(torch.ones(2, 1, 2, dtype=torch.float64), torch.zeros(2, 1, dtype=torch.float64), 0.9)
    with pytest.raises(ValueError, match="gamma"):
        P = torch.full((2, 1, 2), 0.5, dtype=torch.float64)
        copc.TabularMDP(P, torch.zeros(2, 1, dtype=torch.float64), 1.0)


def test_ratio_statistics_and_ess():
    log_r = torch.tensor([[0.0, math.log(2.0), math.log(4.0), 99.0]])
    mask = torch.tensor([[1, 1, 1, 0]], dtype=torch.bool)
    m = copc.ratio_statistics(log_r, mask, "actor")
    assert m["actor/ratio_mean"] == pytest.approx(7 / 3)
    assert m["actor/ratio_max"] == pytest.approx(4.0) and m["actor/ratio_min"] == pytest.approx(1.0)
    assert m["actor/ratio_ess"] == pytest.approx(49 / (3 * 21))
    assert m["actor/ratio_nonfinite_frac"] == 0.0
    empty = copc.ratio_statistics(log_r, torch.zeros_like(mask), "x")
    assert all(v == 0.0 for v in empty.values())


def test_advantage_channel_and_staleness_metrics():
    logp_mu = torch.zeros(1, 4)
    logp_old = torch.tensor([[math.log(0.5), 0.0, math.log(1.5), 5.0]])
    mask = torch.tensor([[1, 1, 1, 0]], dtype=torch.bool)
    m = copc.advantage_channel_metrics(logp_old, logp_mu, mask, 0.8, 1.28)
    assert m["advantage/clipped_frac"] == pytest.approx(2 / 3)
    assert m["advantage/clipped_low_frac"] == pytest.approx(1 / 3)
    versions = torch.tensor([[3, 3, 5, 9]])
    s = copc.staleness_metrics(versions, 8, mask)
    assert (s["staleness/max"], s["staleness/min"]) == (5.0, 3.0)
    assert s["staleness/mean"] == pytest.approx(13 / 3)
    with pytest.raises(ValueError, match="newer than current_version"):
        copc.staleness_metrics(versions, 4, mask)
