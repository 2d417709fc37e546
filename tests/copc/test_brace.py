"""BRACE targets (copc.brace_advantage_return): hand-computed values, the slow reference loop
written from the description, the k = 1 / k ≥ T edge cases, the k → ∞ limit (V-trace), and bad input
(the garbage-at-masked-positions invariance: test_advantages.py, with its siblings)."""

from __future__ import annotations

import pytest
import torch
from reference import brace_reference, vtrace_reference
from test_advantages import random_batch, two_turn

import copc
from copc.brace import BraceSettings

F64 = torch.float64


def test_two_turn_hand_computed_k1():
    """k = 1 on a0 a1 | o2 o3 | a4 a5: δ = [-0.25, 0.75, 0.25, 0.25], ratios [1, 2, 0.5, 1.1]
    → ρ = min(1.2, ·) = [1, 1.2, 0.5, 1.1], c = min(1.1, ·) = [1, 1.1, 0.5, 1.1]; Monte-Carlo
    tails M = [1.0, 1.25, 0.5, 0.25]; D_s = ρ_s δ_s + c_s M_{s+1}:
    a5 0.275, a4 0.125 + 0.125 = 0.25, a1 0.9 + 0.55 = 1.45, a0 −0.25 + 1.25 = 1.0."""
    adv, ret = copc.brace_advantage_return(**two_turn(), rho_clip=1.2, c_clip=1.1, horizon=1)
    exp_ret = torch.tensor([[1.5, 1.7, 0, 0, 0.75, 1.025, 0]], dtype=F64)
    # ρ_s (δ_s + D_{s+1}): a0 1·(−0.25 + 1.45), a1 1.2·(0.75 + 0.25), a4 0.5·(0.25 + 0.275), a5 1.1·0.25
    exp_adv = torch.tensor([[1.2, 1.2, 0, 0, 0.2625, 0.275, 0]], dtype=F64)
    torch.testing.assert_close(ret, exp_ret, atol=1e-12, rtol=0)
    torch.testing.assert_close(adv, exp_adv, atol=1e-12, rtol=0)


def test_two_turn_k2_reads_the_observation_tokens_as_no_step():
    """k = 2 from a1: its horizon is a1 and a4 (o2 o3 consume nothing):
    D_a1 = ρ_a1 δ_a1 + c_a1 (ρ_a4 δ_a4 + c_a4 M_a5) = 0.9 + 1.1 (0.125 + 0.125) = 1.175."""
    _, ret = copc.brace_advantage_return(**two_turn(), rho_clip=1.2, c_clip=1.1, horizon=2)
    assert ret[0, 1].item() == pytest.approx(0.25 + 1.175, abs=1e-12)


@pytest.mark.parametrize("gamma,lam", [(1.0, 1.0), (0.95, 0.9), (0.9, 0.5)])
@pytest.mark.parametrize("k", [1, 2, 7, 100])
def test_matches_the_reference_loop_float64(gamma, lam, k):
    g = torch.Generator().manual_seed(17 + k)
    for rho_clip, c_clip in ((1.2, 1.1), (2.0, 0.5)):
        x = random_batch(g, 5, 160, F64)
        boot = torch.randn(5, generator=g, dtype=F64)
        adv, ret = copc.brace_advantage_return(**x, gamma=gamma, lam=lam, rho_clip=rho_clip,
                                               c_clip=c_clip, horizon=k, bootstrap_values=boot)
        ra, rr = brace_reference(x["rewards"], x["values"], x["logp_old"], x["logp_mu"],
                                 x["loss_mask"], gamma, lam, rho_clip, c_clip, k, boot)
        torch.testing.assert_close(ret, rr, atol=1e-12, rtol=0)
        torch.testing.assert_close(adv, ra, atol=1e-12, rtol=0)


@pytest.mark.parametrize("k", [160, 161, 10**6])
def test_k_at_least_the_row_length_is_vtrace(k):
    g = torch.Generator().manual_seed(5)
    x = random_batch(g, 4, 160, F64)
    a, r = copc.brace_advantage_return(**x, gamma=0.95, lam=0.9, horizon=k)
    va, vr = vtrace_reference(x["rewards"], x["values"], x["logp_old"], x["logp_mu"], x["loss_mask"],
                              0.95, 0.9, 1.2, 1.1)
    torch.testing.assert_close(r, vr, atol=1e-12, rtol=0)
    torch.testing.assert_close(a, va, atol=1e-12, rtol=0)
    b, s = copc.vtrace_advantage_return(**x, gamma=0.95, lam=0.9, rho_clip=1.2, c_clip=1.1)
    torch.testing.assert_close(r, s, atol=1e-12, rtol=0)
    torch.testing.assert_close(a, b, atol=1e-12, rtol=0)


def test_the_tail_is_an_anchored_monte_carlo_return():
    """γ = λ = 1, ratios ≡ 1 (on-policy): every weight is 1 and every target is the Monte-Carlo
    return whatever k; with k small and off-policy ratios the target of t differs from V-trace's."""
    g = torch.Generator().manual_seed(8)
    x = random_batch(g, 3, 90, F64)
    x["logp_mu"] = x["logp_old"].clone()
    _, mc = copc.gae_advantage_return(x["rewards"], x["values"], x["loss_mask"])
    for k in (1, 3, 50):
        _, ret = copc.brace_advantage_return(**x, horizon=k)
        torch.testing.assert_close(ret, mc, atol=1e-12, rtol=0)
    y = random_batch(g, 3, 90, F64)
    _, r1 = copc.brace_advantage_return(**y, horizon=1)
    _, rv = copc.vtrace_advantage_return(**y, rho_clip=1.2, c_clip=1.1)
    assert (r1 - rv).abs().max() > 1e-3


def test_per_row_lambda_is_each_row_alone():
    g = torch.Generator().manual_seed(9)
    x = random_batch(g, 4, 70, F64)
    lam = torch.tensor([1.0, 0.9, 0.5, 0.0], dtype=F64)
    adv, ret = copc.brace_advantage_return(**x, lam=lam, horizon=5)
    for b in range(4):
        row = {k: v[b:b + 1] for k, v in x.items()}
        a, r = copc.brace_advantage_return(**row, lam=float(lam[b]), horizon=5)
        torch.testing.assert_close(adv[b:b + 1], a, atol=1e-12, rtol=0)
        torch.testing.assert_close(ret[b:b + 1], r, atol=1e-12, rtol=0)


def test_empty_and_actionless_rows():
    z = torch.zeros(2, 0, dtype=F64)
    adv, ret = copc.brace_advantage_return(z, z, z, z, torch.zeros(2, 0, dtype=torch.bool))
    assert adv.shape == (2, 0) and ret.shape == (2, 0)
    y = random_batch(torch.Generator().manual_seed(2), 3, 20, F64)
    y["loss_mask"][1] = False
    y["rewards"][1] = 0.0
    adv, ret = copc.brace_advantage_return(**y, horizon=3)
    assert bool((adv[1] == 0).all()) and bool((ret[1] == 0).all())


def test_half_inputs_are_computed_in_float32():
    x = random_batch(torch.Generator().manual_seed(3), 2, 40)
    half = {k: (v.to(torch.bfloat16) if v.is_floating_point() else v) for k, v in x.items()}
    adv, ret = copc.brace_advantage_return(**half, horizon=3)
    assert adv.dtype == ret.dtype == torch.float32


@pytest.mark.parametrize("bad,msg", [
    ({"horizon": 0}, "horizon must be an int >= 1"),
    ({"horizon": 2.5}, "horizon must be an int >= 1"),
    ({"horizon": True}, "horizon must be an int >= 1"),
    ({"rho_clip": 0.0}, "rho_clip must be > 0"),
    ({"c_clip": -1.0}, "c_clip must be > 0"),
    ({"gamma": 1.5}, "gamma"),
])
def test_bad_input_is_one_line_naming_the_field(bad, msg):
    x = random_batch(torch.Generator().manual_seed(4), 2, 10, F64)
    with pytest.raises(ValueError, match=msg):
        copc.brace_advantage_return(**x, **bad)


def test_nan_log_ratio_at_an_action_token_is_refused():
    x = two_turn()
    x["logp_old"][0, 4] = float("-inf")
    x["logp_mu"][0, 4] = float("-inf")
    with pytest.raises(ValueError, match="brace_advantage_return"):
        copc.brace_advantage_return(**x)


def test_settings_validate_the_horizon():
    assert BraceSettings().horizon == 100
    with pytest.raises(ValueError, match="horizon must be an int >= 1"):
        BraceSettings(horizon=0)


def _three_tokens():
    """One row of 3 action tokens: V = [0.5, 0.2, 0.4], outcome reward 1, ratios [2, 0.5, 1]."""
    mask = torch.ones(1, 3, dtype=torch.bool)
    logp_mu = torch.tensor([[-1.0, -0.5, -0.2]], dtype=F64)
    return {"rewards": torch.tensor([[0.0, 0.0, 1.0]], dtype=F64),
            "values": torch.tensor([[0.5, 0.2, 0.4]], dtype=F64),
            "logp_old": logp_mu + torch.tensor([[2.0, 0.5, 1.0]], dtype=F64).log(),
            "logp_mu": logp_mu, "loss_mask": mask}


@pytest.mark.parametrize("tail,exp_ret,exp_adv", [
    # δ = [−0.3, 0.2, 0.6], ρ = [1.2, 0.5, 1], c = [1.1, 0.5, 1], Monte-Carlo tails M = [0.5, 0.8, 0.6];
    # product kept: D2 = 0.6, D1 = 0.5·0.2 + 0.5·M2 = 0.4, D0 = 1.2·(−0.3) + 1.1·M1 = 0.52
    ("product_kept", [1.02, 0.6, 1.0], [1.2 * (-0.3 + 0.4), 0.5 * (0.2 + 0.6), 0.6]),
    # literal (weight 1, no product): D1 = 0.1 + M2 = 0.7, D0 = −0.36 + M1 = 0.44
    ("literal", [0.94, 0.9, 1.0], [1.2 * (-0.3 + 0.7), 0.5 * (0.2 + 0.6), 0.6]),
])
def test_the_two_tail_readings_hand_computed_k1(tail, exp_ret, exp_adv):
    adv, ret = copc.brace_advantage_return(**_three_tokens(), rho_clip=1.2, c_clip=1.1, horizon=1, tail=tail)
    torch.testing.assert_close(ret, torch.tensor([exp_ret], dtype=F64), atol=1e-15, rtol=0)
    torch.testing.assert_close(adv, torch.tensor([exp_adv], dtype=F64), atol=1e-15, rtol=0)


def test_the_two_tail_readings_hand_computed_k2():
    """k = 2 from t = 0: product kept −0.36 + 1.1·0.5·0.2 + 1.1·0.5·0.6 = 0.08; literal
    −0.36 + 0.11 + 0.6 = 0.35 (the k = 2 tail is δ2 = 0.6 alone)."""
    kept = copc.brace_advantage_return(**_three_tokens(), rho_clip=1.2, c_clip=1.1, horizon=2)[1]
    lit = copc.brace_advantage_return(**_three_tokens(), rho_clip=1.2, c_clip=1.1, horizon=2,
                                      tail="literal")[1]
    assert kept[0, 0].item() == pytest.approx(0.5 + 0.08, abs=1e-15)
    assert lit[0, 0].item() == pytest.approx(0.5 + 0.35, abs=1e-15)


@pytest.mark.parametrize("tail", ["product_kept", "literal"])
@pytest.mark.parametrize("gamma,lam", [(1.0, 1.0), (0.95, 0.9)])
@pytest.mark.parametrize("k", [1, 3, 40])
def test_each_tail_reading_matches_the_reference_loop_to_1e15(tail, gamma, lam, k):
    """Random multi-turn rows of 60 tokens with bootstrap values, both readings against the slow
    unrolled sum (float64)."""
    g = torch.Generator().manual_seed(31 + k)
    x = random_batch(g, 4, 60, F64)
    boot = torch.randn(4, generator=g, dtype=F64)
    adv, ret = copc.brace_advantage_return(**x, gamma=gamma, lam=lam, rho_clip=1.2, c_clip=1.1, horizon=k,
                                           bootstrap_values=boot, tail=tail)
    ra, rr = brace_reference(x["rewards"], x["values"], x["logp_old"], x["logp_mu"], x["loss_mask"],
                             gamma, lam, 1.2, 1.1, k, boot, tail=tail)
    scale = max(1.0, float(rr.abs().max()))
    torch.testing.assert_close(ret, rr, atol=1e-15 * scale * 8, rtol=0)
    torch.testing.assert_close(adv, ra, atol=1e-15 * scale * 8, rtol=0)


def test_the_readings_differ_off_policy_and_agree_on_policy_or_beyond_the_row():
    g = torch.Generator().manual_seed(12)
    x = random_batch(g, 4, 80, F64)
    kept = copc.brace_advantage_return(**x, horizon=2)[1]
    lit = copc.brace_advantage_return(**x, horizon=2, tail="literal")[1]
    assert (kept - lit).abs().max() > 0.1
    for k in (80, 10**6):  # k ≥ the row: both are V-trace
        torch.testing.assert_close(copc.brace_advantage_return(**x, horizon=k, tail="literal")[1],
                                   copc.brace_advantage_return(**x, horizon=k)[1], atol=1e-15, rtol=0)
    x["logp_mu"] = x["logp_old"].clone()  # on-policy, λ = 1: every weight 1 in both readings
    torch.testing.assert_close(copc.brace_advantage_return(**x, horizon=2, tail="literal")[1],
                               copc.brace_advantage_return(**x, horizon=2)[1], atol=1e-12, rtol=0)


def test_the_tail_setting_reaches_the_estimator_and_bad_values_are_one_line():
    assert BraceSettings().tail == "product_kept"
    g = torch.Generator().manual_seed(13)
    x = random_batch(g, 3, 40, F64)
    inputs = copc.AdvantageInputs(rewards=x["rewards"], loss_mask=x["loss_mask"], values=x["values"],
                                  logp_old=x["logp_old"], logp_mu=x["logp_mu"])
    algo = copc.get_preset("brace", estimator_settings={"horizon": 2, "tail": "literal"},
                           normalize_advantages=False)
    _, ret = copc.compute_advantages(inputs, algo)
    _, lit = copc.brace_advantage_return(**x, horizon=2, tail="literal")
    torch.testing.assert_close(ret, lit, atol=0, rtol=0)
    with pytest.raises(ValueError, match=r"^tail='last': must be one of 'product_kept', 'literal'$"):
        BraceSettings(tail="last")
    with pytest.raises(ValueError, match=r"^estimator_settings.tail=.last.: must be one of"):
        copc.get_preset("brace", estimator_settings={"tail": "last"})
    with pytest.raises(ValueError, match="tail=None: must be one of"):
        copc.brace_advantage_return(**x, tail=None)
