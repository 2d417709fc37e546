"""Pooled π-referenced value probes (copc.value_probe_window) and the probes' standard errors
(copc.value_probes.probe_metrics): hand-computed values, a slow reference loop, pooling = the
estimator on the union of the window's episodes (not a mean of means), the window's state, and the
power statement of docs/research.md on the exact toy (scripts/value_probe_power.py's tree)."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import pytest
import torch

from copc.component_settings import ValueProbeSettings
from copc.value_probe_window import ValueProbeWindow
from copc.value_probes import ProbeTerms, policy_value_metrics, probe_metrics, probe_terms

F64 = torch.float64
SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "value_probe_power.py"


def _script():
    spec = importlib.util.spec_from_file_location("value_probe_power", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _batch(g, B, T=6):
    """Random ``(values, rewards, logp_old, logp_mu, mask)`` float64 with every row acting."""
    mask = torch.rand(B, T, generator=g) > 0.3
    mask[:, 0] = True
    rewards = torch.where(mask, torch.randn(B, T, generator=g, dtype=F64), 0.0)
    lo = -torch.rand(B, T, generator=g, dtype=F64)
    return (torch.randn(B, T, generator=g, dtype=F64), rewards, lo,
            lo + 0.4 * torch.randn(B, T, generator=g, dtype=F64), mask)


def test_standard_errors_hand_computed():
    """Two one-token episodes, V̂ = 1, R = (0, 1), w = (1, 3): Ê_π = 3/4, Ê_µ = 1/2, w̄ = 2;
    influence of the IS mean w (R − 3/4)/w̄ = (−0.375, 0.375): gap SE √(2 · 0.375²)/2,
    b̂'s (−0.375 + 0.5, 0.375 − 0.5) → SE √(2 · 0.125²)/2."""
    values = torch.ones(2, 1, dtype=F64)
    rewards = torch.tensor([[0.0], [1.0]], dtype=F64)
    logp_mu = torch.tensor([[-1.0], [-2.0]], dtype=F64)
    logp_old = logp_mu + torch.tensor([[0.0], [math.log(3.0)]], dtype=F64)
    m = policy_value_metrics(values, rewards, logp_old, logp_mu, torch.ones(2, 1, dtype=torch.bool), 1.0)
    assert m["value/policy_value_gap"] == pytest.approx(0.25, abs=1e-15)
    assert m["value/b_hat"] == pytest.approx(0.25, abs=1e-15)
    assert m["value/se_gap"] == pytest.approx(math.sqrt(2 * 0.375 ** 2) / 2, abs=1e-15)
    assert m["value/se_b_hat"] == pytest.approx(math.sqrt(2 * 0.125 ** 2) / 2, abs=1e-15)


def _slow_se(v, r, w):
    """The delta-method SEs, one episode at a time in Python floats."""
    n = len(w)
    e_pi = sum(wi * ri for wi, ri in zip(w, r, strict=True)) / sum(w)
    e_mu, v_mean, w_bar = sum(r) / n, sum(v) / n, sum(w) / n
    psi_d = [(vi - v_mean) - wi * (ri - e_pi) / w_bar for vi, ri, wi in zip(v, r, w, strict=True)]
    psi_b = [wi * (ri - e_pi) / w_bar - (ri - e_mu) for ri, wi in zip(r, w, strict=True)]
    return math.sqrt(sum(x * x for x in psi_d)) / n, math.sqrt(sum(x * x for x in psi_b)) / n


def test_standard_errors_match_a_slow_loop_and_owen_s_form_with_a_constant_critic():
    g = torch.Generator().manual_seed(3)
    for B in (1, 5, 40):
        t = probe_terms(*_batch(g, B), 0.9, weight_cap=2.0)
        m = probe_metrics(t)
        se_d, se_b = _slow_se(t.v.tolist(), t.r.tolist(), t.w.tolist())
        assert m["value/se_gap"] == pytest.approx(se_d, rel=1e-13, abs=1e-15)
        assert m["value/se_b_hat"] == pytest.approx(se_b, rel=1e-13, abs=1e-15)
        # a constant critic: the gap's SE is Owen's self-normalised IS one, √Σ w²(R − Ê_π)² / Σ w
        c = ProbeTerms(torch.full_like(t.v, 0.3), t.r, t.w, t.capped)
        e_pi = float((t.w * t.r).sum() / t.w.sum())
        owen = float((t.w.square() * (t.r - e_pi).square()).sum().sqrt() / t.w.sum())
        assert probe_metrics(c)["value/se_gap"] == pytest.approx(owen, rel=1e-13)


def test_pooled_is_the_estimator_on_the_union_of_the_window_s_episodes():
    g = torch.Generator().manual_seed(5)
    batches = [_batch(g, B) for B in (3, 8, 5, 2)]
    win = ValueProbeWindow(ValueProbeSettings(window_steps=3))
    for i, b in enumerate(batches):
        out = win.update(probe_terms(*b, 1.0))
        last = batches[max(0, i - 2):i + 1]  # at most W = 3 steps: the oldest drops
        union = [torch.cat([x[k] for x in last]) for k in range(5)]
        ref = policy_value_metrics(*union, 1.0)
        for k, v in ref.items():
            assert out[k.replace("value/", "value/pooled_")] == pytest.approx(v, rel=1e-14, abs=1e-15)
        assert out["value/pooled_episodes"] == sum(x[0].shape[0] for x in last)
        assert out["value/pooled_steps"] == len(last)
    assert win.update(None) == {} and len(win.steps) == 3


def test_pooling_weighs_episodes_not_steps():
    """Step 1: one episode, V̂ 0, R 1, w 1; step 2: three episodes, V̂ 0, R 0, w 1. Pooled b̂ is 0
    (on-policy) and the pooled gap |0 − 1/4| = 0.25, not the mean of the step gaps (1 + 0)/2."""
    one = ProbeTerms(*(torch.tensor([x], dtype=F64) for x in (0.0, 1.0, 1.0, 0.0)))
    three = ProbeTerms(torch.zeros(3, dtype=F64), torch.zeros(3, dtype=F64), torch.ones(3, dtype=F64),
                       torch.zeros(3, dtype=F64))
    win = ValueProbeWindow()
    assert win.update(one)["value/pooled_policy_value_gap"] == 1.0
    out = win.update(three)
    assert out["value/pooled_policy_value_gap"] == 0.25 and out["value/pooled_b_hat"] == 0.0
    assert probe_metrics(three)["value/policy_value_gap"] == 0.0


def test_state_round_trip_old_checkpoints_and_bad_state():
    g = torch.Generator().manual_seed(6)
    a = ValueProbeWindow(ValueProbeSettings(window_steps=2))
    for B in (4, 3, 6):
        a.update(probe_terms(*_batch(g, B), 1.0))
    b = ValueProbeWindow(ValueProbeSettings(window_steps=2))
    b.load_state_dict(a.state_dict())
    nxt = probe_terms(*_batch(g, 5), 1.0)
    assert a.update(nxt) == b.update(nxt)
    c = ValueProbeWindow(ValueProbeSettings(window_steps=1))  # a smaller W keeps the newest
    c.load_state_dict(a.state_dict())
    assert len(c.steps) == 1 and torch.equal(c.steps[0].r, nxt.r)
    c.load_state_dict({"value_bias_ema": 0.3})  # a checkpoint from before the window
    assert len(c.steps) == 0
    with pytest.raises(ValueError, match="value_probe_window must be a list of"):
        c.load_state_dict({"value_probe_window": [torch.zeros(3, 2)]})


def test_the_window_keeps_cpu_float64_whatever_the_step_s_terms_are():
    """A checkpoint reloads the window on the CPU in float64; steps must be stored the same way, or a
    backend whose batch lives on a GPU (megatron) joins CPU and GPU tensors after a resume (found by
    review; no GPU here, so the invariant is tested with float32 terms)."""
    g = torch.Generator().manual_seed(7)
    t32 = probe_terms(*_batch(g, 4), 1.0)
    t32 = ProbeTerms(*(x.float() for x in (t32.v, t32.r, t32.w, t32.capped)))
    w = ValueProbeWindow(ValueProbeSettings(window_steps=3))
    w.update(t32)
    assert all(getattr(w.steps[0], c).dtype == torch.float64 and getattr(w.steps[0], c).device.type == "cpu"
               for c in ("v", "r", "w", "capped"))
    restored = ValueProbeWindow(ValueProbeSettings(window_steps=3))
    restored.load_state_dict(w.state_dict())
    nxt = probe_terms(*_batch(g, 5), 1.0)
    assert restored.update(nxt) == w.update(nxt)


@pytest.mark.parametrize("bad,msg", [({"window_steps": 0}, "window_steps=0: must be an int >= 1"),
                                     ({"window_steps": 2.0}, "window_steps=2.0"),
                                     ({"weight_cap": 0}, "weight_cap=0: must be a number > 0")])
def test_settings_refuse_bad_values_naming_the_field(bad, msg):
    with pytest.raises(ValueError, match=msg):
        ValueProbeSettings(**bad)


def test_at_the_default_window_a_v_mu_critic_is_told_from_a_v_pi_one_and_at_one_step_it_is_not():
    """The toy of docs/research.md (V^π − V^µ = −0.117): 100 seeded runs of 32 steps of B = 16
    episodes from µ, each fed to a window of the default W = 32 (512 episodes) for both exact
    critics. Pooled, the V^µ critic's gap exceeds 2 of its SEs in ≥ 80 % of runs and the V^π
    critic's in ≤ 10 %; one step alone (the last, B = 16) flags the V^µ critic in ≤ 35 % of runs,
    no better than chance ×3 (the V^π critic's rate at B = 16 is ~12 %)."""
    mod = _script()
    t_pi, t_mu, p_mu = mod.trajectory_terms(mod.toy())
    assert ValueProbeSettings().window_steps == 32
    g = torch.Generator().manual_seed(0)
    runs, B = 100, 16
    pooled_hits = {"pi": 0, "mu": 0}
    step_hits = 0
    for _ in range(runs):
        wins = {"pi": ValueProbeWindow(), "mu": ValueProbeWindow()}
        for _ in range(32):
            idx = torch.multinomial(p_mu, B, replacement=True, generator=g)
            out = {k: wins[k].update(mod.rows(t, idx)) for k, t in (("pi", t_pi), ("mu", t_mu))}
        for k in pooled_hits:
            pooled_hits[k] += out[k]["value/pooled_policy_value_gap"] > 2 * out[k]["value/pooled_se_gap"]
        single = probe_metrics(mod.rows(t_mu, idx))
        step_hits += single["value/policy_value_gap"] > 2 * single["value/se_gap"]
    assert out["mu"]["value/pooled_episodes"] == 512
    assert pooled_hits["mu"] / runs >= 0.8
    assert pooled_hits["pi"] / runs <= 0.1
    assert step_hits / runs <= 0.35
