"""Advantage channel: hand-computed values, slow reference loops, invariances, bad input."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from reference import coupled_reference, random_multiturn_mask, vtrace_reference

import copc

F64 = torch.float64


def two_turn() -> dict[str, torch.Tensor]:
    """One row: actions a0 a1 | observations o2 o3 | actions a4 a5 | padding.

    Outcome reward 1 on a5, and reward 0.5 on observation o3 (folded onto a1).
    Ratios π_old/µ: a0 1.0, a1 2.0 (→ 1.28), a4 0.5 (→ 0.8), a5 1.1.
    """
    nan = float("nan")
    mask = torch.tensor([[1, 1, 0, 0, 1, 1, 0]], dtype=torch.bool)
    rewards = torch.tensor([[0.0, 0.0, 0.0, 0.5, 0.0, 1.0, 0.0]], dtype=F64)
    values = torch.tensor([[0.5, 0.25, nan, 7.0, 0.5, 0.75, -3.0]], dtype=F64)
    ratio = torch.tensor([[1.0, 2.0, 1.0, 1.0, 0.5, 1.1, 1.0]], dtype=F64)
    logp_mu = torch.tensor([[-1.0, -2.0, nan, 0.0, -0.5, -0.3, float("inf")]], dtype=F64)
    logp_old = torch.where(mask, logp_mu + ratio.log(), torch.full_like(ratio, -9.0))
    return {"rewards": rewards, "values": values, "logp_old": logp_old, "logp_mu": logp_mu,
            "loss_mask": mask}


def test_two_turn_hand_computed_copc_gamma_lambda_1():
    x = two_turn()
    adv, ret = copc.coupled_advantage_return(**x)
    # δ = [-0.25, 0.75, 0.25, 0.25] on a0 a1 a4 a5; ρ̄ = [1, 1.28, 0.8, 1.1]
    # G_a5 = 0.275, G_a4 = 0.475, G_a1 = 1.435, G_a0 = 1.185
    exp_adv = torch.tensor([[1.185, 1.225, 0, 0, 0.525, 0.25, 0]], dtype=F64)
    exp_ret = torch.tensor([[1.685, 1.685, 0, 0, 0.975, 1.025, 0]], dtype=F64)
    torch.testing.assert_close(adv, exp_adv, atol=1e-12, rtol=0)
    torch.testing.assert_close(ret, exp_ret, atol=1e-12, rtol=0)


def test_two_turn_hand_computed_gae_gamma_half():
    x = two_turn()
    adv, ret = copc.gae_advantage_return(x["rewards"], x["values"], x["loss_mask"], gamma=0.5, lam=1.0)
    # observation tokens are skipped, not discounted: returns are Monte-Carlo returns
    # over action steps: a0: 0.5*0.5 + 0.5^3*1 = 0.375, a1: 0.5 + 0.25 = 0.75, a4: 0.5, a5: 1
    exp_ret = torch.tensor([[0.375, 0.75, 0, 0, 0.5, 1.0, 0]], dtype=F64)
    exp_adv = exp_ret - torch.where(x["loss_mask"], x["values"], 0.0)
    torch.testing.assert_close(ret, exp_ret, atol=1e-12, rtol=0)
    torch.testing.assert_close(adv, exp_adv, atol=1e-12, rtol=0)


def test_two_turn_gae_is_monte_carlo_at_gamma_lambda_1():
    x = two_turn()
    adv, ret = copc.gae_advantage_return(x["rewards"], x["values"], x["loss_mask"])
    torch.testing.assert_close(ret, torch.tensor([[1.5, 1.5, 0, 0, 1.0, 1.0, 0]], dtype=F64))
    torch.testing.assert_close(adv, torch.tensor([[1.0, 1.25, 0, 0, 0.5, 0.25, 0]], dtype=F64))


def test_bootstrap_value_for_truncated_rows():
    x = two_turn()
    boot = torch.tensor([2.0], dtype=F64)
    _, ret = copc.gae_advantage_return(x["rewards"], x["values"], x["loss_mask"], bootstrap_values=boot)
    # every return gains the bootstrap value (γ = λ = 1)
    torch.testing.assert_close(ret, torch.tensor([[3.5, 3.5, 0, 0, 3.0, 3.0, 0]], dtype=F64))


def random_batch(g: torch.Generator, B: int, T: int, dtype=torch.float32) -> dict[str, torch.Tensor]:
    mask = random_multiturn_mask(B, T, g)
    rewards = torch.randn(B, T, generator=g) * (torch.rand(B, T, generator=g) < 0.2)
    has = mask.any(1)
    first = torch.where(has, mask.float().argmax(1), torch.full((B,), T))
    before_first = torch.arange(T)[None, :] < first[:, None]
    rewards = rewards.masked_fill(before_first, 0.0)  # nothing to fold onto before the first action
    logp_old = -torch.rand(B, T, generator=g) * 3
    return {
        "rewards": rewards.to(dtype),
        "values": torch.randn(B, T, generator=g).to(dtype),
        "logp_old": logp_old.to(dtype),
        "logp_mu": (logp_old + 0.4 * torch.randn(B, T, generator=g)).to(dtype),
        "loss_mask": mask,
    }


@pytest.mark.parametrize("gamma", [1.0, 0.95])
@pytest.mark.parametrize("lam", [1.0, 0.95])
@pytest.mark.parametrize("eta_a", [0.5, 0.25, 1.0])
def test_coupled_matches_reference_loop(gamma, lam, eta_a):
    g = torch.Generator().manual_seed(int(gamma * 100 + lam * 10 + eta_a * 1000))
    low, high = copc.margins(eta_a)
    for _ in range(6):
        T = int(torch.randint(1, 600, (1,), generator=g))
        x = random_batch(g, 4, T)
        boot = torch.randn(4, generator=g)
        adv, ret = copc.coupled_advantage_return(**x, gamma=gamma, lam=lam, eta_a=eta_a,
                                                 bootstrap_values=boot)
        ra, rr = coupled_reference(x["rewards"], x["values"], x["logp_old"], x["logp_mu"],
                                   x["loss_mask"], gamma, lam, low, high, boot)
        torch.testing.assert_close(adv.double(), ra, atol=5e-5, rtol=1e-5)
        torch.testing.assert_close(ret.double(), rr, atol=5e-5, rtol=1e-5)


@pytest.mark.parametrize("gamma,lam", [(1.0, 1.0), (0.95, 0.95), (0.9, 0.5), (1.0, 0.0)])
def test_coupled_matches_reference_float64_long_rows(gamma, lam):
    """Long rows span many scan blocks; float64 must agree to 1e-9."""
    g = torch.Generator().manual_seed(7)
    x = random_batch(g, 3, 3000, F64)
    adv, ret = copc.coupled_advantage_return(**x, gamma=gamma, lam=lam)
    ra, rr = coupled_reference(x["rewards"], x["values"], x["logp_old"], x["logp_mu"], x["loss_mask"],
                               gamma, lam, 0.8, 1.28)
    torch.testing.assert_close(adv, ra, atol=1e-9, rtol=1e-9)
    torch.testing.assert_close(ret, rr, atol=1e-9, rtol=1e-9)


@settings(max_examples=40, deadline=None)
@given(data=st.data(), T=st.integers(1, 40), B=st.integers(1, 4),
       gamma=st.sampled_from([1.0, 0.95]), lam=st.sampled_from([1.0, 0.95]))
def test_coupled_matches_reference_hypothesis(data, T, B, gamma, lam):
    mask = torch.tensor(data.draw(st.lists(st.lists(st.booleans(), min_size=T, max_size=T),
                                           min_size=B, max_size=B)))
    seed = data.draw(st.integers(0, 2**31 - 1))
    g = torch.Generator().manual_seed(seed)
    x = random_batch(g, B, T, F64)
    x["loss_mask"] = mask
    has = mask.any(1)
    first = torch.where(has, mask.double().argmax(1), torch.full((B,), T))
    x["rewards"] = x["rewards"].masked_fill(torch.arange(T)[None] < first[:, None], 0.0)
    adv, ret = copc.coupled_advantage_return(**x, gamma=gamma, lam=lam)
    ra, rr = coupled_reference(x["rewards"], x["values"], x["logp_old"], x["logp_mu"], mask,
                               gamma, lam, 0.8, 1.28)
    torch.testing.assert_close(adv, ra, atol=1e-10, rtol=1e-10)
    torch.testing.assert_close(ret, rr, atol=1e-10, rtol=1e-10)


@pytest.mark.parametrize("gamma,lam", [(1.0, 1.0), (0.95, 0.95), (1.0, 0.9)])
def test_vtrace_matches_reference_loop(gamma, lam):
    g = torch.Generator().manual_seed(3)
    for rho_clip, c_clip in ((1.0, 1.0), (2.0, 0.5)):
        x = random_batch(g, 4, 200, F64)
        boot = torch.randn(4, generator=g, dtype=F64)
        adv, ret = copc.vtrace_advantage_return(**x, gamma=gamma, lam=lam, rho_clip=rho_clip,
                                                c_clip=c_clip, bootstrap_values=boot)
        ra, rr = vtrace_reference(x["rewards"], x["values"], x["logp_old"], x["logp_mu"],
                                  x["loss_mask"], gamma, lam, rho_clip, c_clip, boot)
        torch.testing.assert_close(adv, ra, atol=1e-10, rtol=1e-10)
        torch.testing.assert_close(ret, rr, atol=1e-10, rtol=1e-10)


def test_vtrace_on_policy_equals_gae_returns():
    """ratio ≡ 1 and ρ̄ = c̄ = 1: V-trace targets are the λ-returns of GAE."""
    g = torch.Generator().manual_seed(4)
    x = random_batch(g, 3, 100, F64)
    x["logp_mu"] = x["logp_old"].clone()
    _, ret_v = copc.vtrace_advantage_return(**x, gamma=0.9, lam=0.8)
    _, ret_g = copc.gae_advantage_return(x["rewards"], x["values"], x["loss_mask"], gamma=0.9, lam=0.8)
    torch.testing.assert_close(ret_v, ret_g, atol=1e-12, rtol=0)


@pytest.mark.parametrize("gamma,lam", [(1.0, 1.0), (0.95, 0.95), (0.9, 0.5)])
def test_eta_a_zero_is_gae_bit_for_bit(gamma, lam):
    g = torch.Generator().manual_seed(11)
    x = random_batch(g, 8, 777)
    adv_c, ret_c = copc.coupled_advantage_return(**x, gamma=gamma, lam=lam, eta_a=0.0)
    adv_g, ret_g = copc.gae_advantage_return(x["rewards"], x["values"], x["loss_mask"], gamma=gamma,
                                             lam=lam)
    assert torch.equal(adv_c, adv_g)
    assert torch.equal(ret_c, ret_g)
    # and η_A > 0 really changes something on this off-policy batch
    adv_1, _ = copc.coupled_advantage_return(**x, gamma=gamma, lam=lam, eta_a=0.5)
    assert not torch.equal(adv_1, adv_g)


def _garbage_like(x: torch.Tensor, g: torch.Generator) -> torch.Tensor:
    junk = torch.randn(x.shape, generator=g, dtype=x.dtype) * 1e6
    specials = torch.tensor([float("nan"), float("inf"), -float("inf"), 1e30], dtype=x.dtype)
    pick = torch.randint(0, 5, x.shape, generator=g)
    return torch.where(pick < 4, specials[pick.clamp(max=3)], junk)


@pytest.mark.parametrize("fn", ["copc", "gae", "vtrace", "brace"])
@pytest.mark.parametrize("gamma,lam", [(1.0, 1.0), (0.95, 0.9)])
def test_garbage_at_mask0_positions_leaves_outputs_bit_identical(fn, gamma, lam):
    g = torch.Generator().manual_seed(5)
    x = random_batch(g, 6, 300)
    m = x["loss_mask"]
    dirty = dict(x)
    for k in ("values", "logp_old", "logp_mu"):
        dirty[k] = torch.where(m, x[k], _garbage_like(x[k], g))
    if fn == "copc":
        a, b = (copc.coupled_advantage_return(**d, gamma=gamma, lam=lam) for d in (x, dirty))
    elif fn == "vtrace":
        a, b = (copc.vtrace_advantage_return(**d, gamma=gamma, lam=lam) for d in (x, dirty))
    elif fn == "brace":
        a, b = (copc.brace_advantage_return(**d, gamma=gamma, lam=lam, horizon=4) for d in (x, dirty))
        assert bool((a[0][~m] == 0).all()) and bool((a[1][~m] == 0).all())
    else:
        a, b = (copc.gae_advantage_return(d["rewards"], d["values"], m, gamma=gamma, lam=lam)
                for d in (x, dirty))
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert torch.isfinite(b[0]).all() and torch.isfinite(b[1]).all()
    assert (a[0][~m] == 0).all() and (a[1][~m] == 0).all()


def test_observation_reward_equals_reward_moved_to_preceding_action():
    x = two_turn()
    moved = dict(x)
    moved["rewards"] = torch.tensor([[0.0, 0.5, 0.0, 0.0, 0.0, 1.0, 0.0]], dtype=F64)
    for a, b in zip(copc.coupled_advantage_return(**x), copc.coupled_advantage_return(**moved), strict=True):
        assert torch.equal(a, b)


def test_observation_reward_error_mode():
    x = two_turn()
    with pytest.raises(ValueError, match=r"rewards\[0, 3\].*obs_reward='error'"):
        copc.coupled_advantage_return(**x, obs_reward="error")


def test_reward_before_first_action_is_refused_not_dropped():
    x = two_turn()
    x["loss_mask"] = torch.tensor([[0, 1, 0, 0, 1, 1, 0]], dtype=torch.bool)
    x["rewards"] = torch.tensor([[0.3, 0, 0, 0, 0, 1.0, 0]], dtype=F64)
    with pytest.raises(ValueError, match=r"rewards\[0, 0\].*no preceding action token"):
        copc.gae_advantage_return(x["rewards"], x["values"], x["loss_mask"])


def test_row_without_action_token_is_all_zeros():
    g = torch.Generator().manual_seed(0)
    x = random_batch(g, 3, 50)
    x["loss_mask"][1] = False
    x["rewards"][1] = 0.0
    adv, ret = copc.coupled_advantage_return(**x)
    assert (adv[1] == 0).all() and (ret[1] == 0).all()
    assert adv[0].abs().sum() > 0


def test_logp_mu_minus_inf_is_defined_upper_clip():
    x = two_turn()
    x["logp_mu"] = x["logp_mu"].clone()
    x["logp_mu"][0, 0] = -math.inf  # ρ = +inf → ρ̄ = u_A = 1.28
    adv, ret = copc.coupled_advantage_return(**x)
    assert torch.isfinite(adv).all() and torch.isfinite(ret).all()
    # only G_a0 changes: 1.28 * (-0.25) instead of 1.0 * (-0.25)
    assert ret[0, 0].item() == pytest.approx(1.685 - 0.28 * 0.25, abs=1e-12)


@pytest.mark.parametrize("field", ["values", "logp_old", "rewards"])
def test_nan_at_action_token_raises_naming_the_input(field):
    x = two_turn()
    x[field] = x[field].clone()
    x[field][0, 4] = float("nan")
    with pytest.raises(ValueError, match=rf"{field}\[0, 4\] = nan"):
        copc.coupled_advantage_return(**x)


def test_both_logps_minus_inf_raise():
    x = two_turn()
    for k in ("logp_old", "logp_mu"):
        x[k] = x[k].clone()
        x[k][0, 1] = -math.inf
    with pytest.raises(ValueError, match="non-finite"):
        copc.coupled_advantage_return(**x)


def test_bad_shapes_and_parameters():
    x = two_turn()
    with pytest.raises(ValueError, match="values has shape"):
        copc.coupled_advantage_return(x["rewards"], x["values"][:, :5], x["logp_old"], x["logp_mu"],
                                      x["loss_mask"])
    with pytest.raises(ValueError, match="rewards has shape"):
        copc.gae_advantage_return(x["rewards"][:, :3], x["values"], x["loss_mask"])
    with pytest.raises(ValueError, match="gamma must be in"):
        copc.gae_advantage_return(x["rewards"], x["values"], x["loss_mask"], gamma=1.5)
    with pytest.raises(ValueError, match="eta must be in"):
        copc.coupled_advantage_return(**x, eta_a=2.0)
    with pytest.raises(ValueError, match="loss_mask must contain only 0 and 1"):
        copc.gae_advantage_return(x["rewards"], x["values"], x["loss_mask"].long() * 2)
    with pytest.raises(ValueError, match="2-D"):
        copc.gae_advantage_return(x["rewards"][0], x["values"][0], x["loss_mask"][0])
    with pytest.raises(TypeError, match="floating"):
        copc.gae_advantage_return(x["rewards"].long(), x["values"], x["loss_mask"])
    with pytest.raises(ValueError, match="bootstrap_values must have shape"):
        copc.gae_advantage_return(x["rewards"], x["values"], x["loss_mask"],
                                  bootstrap_values=torch.zeros(3, dtype=F64))
    with pytest.raises(ValueError, match="rho_clip must be > 0"):
        copc.vtrace_advantage_return(**x, rho_clip=0.0)


def test_float_mask_equals_bool_mask():
    g = torch.Generator().manual_seed(9)
    x = random_batch(g, 3, 64)
    a = copc.coupled_advantage_return(**x)
    x["loss_mask"] = x["loss_mask"].float()
    b = copc.coupled_advantage_return(**x)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def test_margins_paper_defaults():
    assert copc.margins(0.5) == pytest.approx((0.8, 1.28))
    assert copc.margins(0.0) == (1.0, 1.0)
    assert copc.margins(0.25, 0.4, 0.56) == pytest.approx((0.9, 1.14))
