"""VAPO options in copc (docs/vapo.md): per-row λ in the estimators, length-adaptive λ, the
positive-example LM loss, and the validation of the new AlgorithmConfig fields."""

from __future__ import annotations

import math

import pytest
import torch
from reference import coupled_reference, random_multiturn_mask, vtrace_reference

import copc
from copc.advantages import length_adaptive_lambda, per_row_lambda
from copc.policy_losses import positive_lm_loss


def _inputs(B: int, T: int, seed: int, dtype=torch.float64):
    """Random multi-turn rows, outcome reward on each row's last action token, off-policy log-probs."""
    g = torch.Generator().manual_seed(seed)
    mask = random_multiturn_mask(B, T, g)
    rewards = torch.zeros(B, T, dtype=dtype)
    for b in range(B):
        acts = mask[b].nonzero().squeeze(1)
        rewards[b, acts[-1]] = float(torch.randint(0, 2, (1,), generator=g))
    values = torch.randn(B, T, generator=g, dtype=dtype)
    logp_old = -torch.rand(B, T, generator=g, dtype=dtype)
    logp_mu = logp_old + 0.3 * torch.randn(B, T, generator=g, dtype=dtype)
    return rewards, values, logp_old, logp_mu, mask


# -- length-adaptive λ ------------------------------------------------------------------------

def test_length_adaptive_lambda_hand_computed():
    """λ_b = 1 − 1/(α l_b) with l_b the action tokens of row b; clipped at 0; empty rows 0."""
    T = 120
    mask = torch.zeros(6, T, dtype=torch.bool)
    for b, n in enumerate((100, 40, 20, 10, 0)):
        mask[b, :n] = True
    mask[5, :30] = True
    mask[5, 10:20] = False  # an observation in the middle: 20 action tokens
    lam = length_adaptive_lambda(mask, 0.05)
    assert lam.dtype == torch.float64
    assert lam.tolist() == pytest.approx([1 - 1 / 5, 1 - 1 / 2, 0.0, 0.0, 0.0, 0.0], abs=1e-15)
    assert float(length_adaptive_lambda(mask, 0.5)[0]) == pytest.approx(1 - 1 / 50)


@pytest.mark.parametrize("alpha", [0.0, -0.1, float("nan"), "0.05", True])
def test_length_adaptive_lambda_rejects_bad_alpha(alpha):
    with pytest.raises(ValueError, match="length_adaptive_alpha"):
        length_adaptive_lambda(torch.ones(2, 3, dtype=torch.bool), alpha)


# -- per-row λ in the estimators --------------------------------------------------------------

@pytest.mark.parametrize("obs_discount", ["skip", "per_token"])
@pytest.mark.parametrize("gamma", [1.0, 0.97])
def test_coupled_per_row_lambda_matches_reference_loop(gamma, obs_discount):
    """COPC with a (B,) λ: row b is the slow per-token reference run with λ_b (c_b = γ λ_b)."""
    rewards, values, logp_old, logp_mu, mask = _inputs(9, 40, seed=1)
    lam = length_adaptive_lambda(mask, 0.2)
    lo, hi = copc.margins(0.5, 0.4, 0.56)
    adv, ret = copc.coupled_advantage_return(rewards, values, logp_old, logp_mu, mask, gamma=gamma, lam=lam,
                                             eta_a=0.5, obs_discount=obs_discount)
    for b in range(mask.shape[0]):
        sl = slice(b, b + 1)
        ref_a, ref_r = coupled_reference(rewards[sl], values[sl], logp_old[sl], logp_mu[sl], mask[sl], gamma,
                                         float(lam[b]), lo, hi, per_token=obs_discount == "per_token")
        torch.testing.assert_close(adv[sl], ref_a, rtol=0, atol=1e-12)
        torch.testing.assert_close(ret[sl], ref_r, rtol=0, atol=1e-12)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("fn", ["gae", "copc"])
def test_per_row_lambda_is_the_estimator_row_by_row(fn, dtype):
    """Each row equals the scalar-λ estimator run on that row alone with its own λ, bit for bit
    (distinct λ per row: every group is one row, the very same call)."""
    rewards, values, logp_old, logp_mu, mask = _inputs(7, 33, seed=2, dtype=dtype)
    mask[:, :2] = True  # every row has action tokens
    lam = torch.linspace(0.3, 1.0, 7, dtype=torch.float64)[torch.randperm(7, generator=torch.Generator()
                                                                            .manual_seed(0))]

    def run(sl, lam_):
        if fn == "gae":
            return copc.gae_advantage_return(rewards[sl], values[sl], mask[sl], gamma=0.99, lam=lam_)
        return copc.coupled_advantage_return(rewards[sl], values[sl], logp_old[sl], logp_mu[sl], mask[sl],
                                             gamma=0.99, lam=lam_)

    adv, ret = run(slice(None), lam)
    assert adv.dtype == dtype
    for b in range(7):
        a_b, r_b = run(slice(b, b + 1), float(lam[b]))
        assert torch.equal(adv[b], a_b[0]) and torch.equal(ret[b], r_b[0])


@pytest.mark.parametrize("fn", ["gae", "copc", "vtrace"])
def test_constant_per_row_lambda_equals_scalar_lambda(fn):
    """A (B,) λ with one value is the scalar-λ call (bit for bit for GAE/COPC: one group, all rows)."""
    rewards, values, logp_old, logp_mu, mask = _inputs(5, 25, seed=3)
    kw = dict(gamma=0.95)
    est = {"gae": lambda lam: copc.gae_advantage_return(rewards, values, mask, lam=lam, **kw),
           "copc": lambda lam: copc.coupled_advantage_return(rewards, values, logp_old, logp_mu, mask,
                                                             lam=lam, **kw),
           "vtrace": lambda lam: copc.vtrace_advantage_return(rewards, values, logp_old, logp_mu, mask,
                                                              lam=lam, **kw)}[fn]
    a_s, r_s = est(0.9)
    a_t, r_t = est(torch.full((5,), 0.9, dtype=torch.float64))
    if fn == "vtrace":
        torch.testing.assert_close(a_t, a_s, rtol=0, atol=1e-14)
        torch.testing.assert_close(r_t, r_s, rtol=0, atol=1e-14)
    else:
        assert torch.equal(a_t, a_s) and torch.equal(r_t, r_s)


def test_vtrace_per_row_lambda_matches_reference_loop():
    rewards, values, logp_old, logp_mu, mask = _inputs(6, 30, seed=4)
    lam = length_adaptive_lambda(mask, 0.3)
    adv, ret = copc.vtrace_advantage_return(rewards, values, logp_old, logp_mu, mask, gamma=0.99, lam=lam)
    for b in range(6):
        sl = slice(b, b + 1)
        ref_a, ref_r = vtrace_reference(rewards[sl], values[sl], logp_old[sl], logp_mu[sl], mask[sl], 0.99,
                                        float(lam[b]), 1.0, 1.0)
        torch.testing.assert_close(adv[sl], ref_a, rtol=0, atol=1e-12)
        torch.testing.assert_close(ret[sl], ref_r, rtol=0, atol=1e-12)


def test_per_row_lambda_groups_rows_and_calls_once_per_distinct_value():
    calls = []

    def estimate(v, rows):
        calls.append((v, rows.tolist()))
        out = torch.full((len(rows), 2), v, dtype=torch.float64)
        return out, -out

    adv, ret = per_row_lambda(estimate, torch.tensor([0.5, 1.0, 0.5, 0.0]), 4)
    assert calls == [(0.0, [3]), (0.5, [0, 2]), (1.0, [1])]
    assert adv[:, 0].tolist() == [0.5, 1.0, 0.5, 0.0] and torch.equal(ret, -adv)


@pytest.mark.parametrize("lam, match", [
    (torch.tensor([0.5, 1.5, 0.2]), r"lam\[1\] = 1.5"),
    (torch.tensor([0.5, float("nan"), 0.2]), r"lam\[1\] = nan"),
    (torch.tensor([0.5, 0.2]), r"lam must have shape \(3,\)"),
])
def test_per_row_lambda_errors_name_lam(lam, match):
    rewards, values, logp_old, logp_mu, mask = _inputs(3, 10, seed=5)
    with pytest.raises(ValueError, match=match):
        copc.coupled_advantage_return(rewards, values, logp_old, logp_mu, mask, lam=lam)
    with pytest.raises(ValueError, match=match):
        copc.vtrace_advantage_return(rewards, values, logp_old, logp_mu, mask, lam=lam)


def test_per_row_lambda_error_names_the_batch_row():
    """An input error inside a λ group reports the batch rows of that group."""
    rewards, values, _, _, mask = _inputs(3, 10, seed=6)
    mask[:, 0] = True
    values[2, 0] = float("nan")
    with pytest.raises(ValueError, match=r"values\[0, 0\].*batch rows \[2\]"):
        copc.gae_advantage_return(rewards, values, mask, lam=torch.tensor([0.5, 0.5, 0.9]))


# -- positive-example LM loss -----------------------------------------------------------------

LOGP = torch.tensor([[-1.0, -2.0, -3.0, 0.0],
                     [-0.5, -0.5, 0.0, 0.0],
                     [-4.0, -2.0, -6.0, -1.0]])
MASK = torch.tensor([[1, 1, 0, 1],
                     [1, 1, 0, 0],
                     [0, 1, 1, 0]], dtype=torch.bool)


@pytest.mark.parametrize("mode, expected", [
    # positive rows 0 and 2: tokens (−1, −2, 0) and (−2, −6) → NLL 1, 2, 0, 2, 6
    ("token-mean", (1 + 2 + 0 + 2 + 6) / 5),
    ("seq-mean-token-mean", ((1 + 2 + 0) / 3 + (2 + 6) / 2) / 2),
    ("seq-mean-token-sum", ((1 + 2 + 0) + (2 + 6)) / 2),
])
def test_positive_lm_loss_hand_computed(mode, expected):
    loss, met = positive_lm_loss(LOGP, MASK, torch.tensor([True, False, True]), loss_agg_mode=mode)
    assert float(loss) == pytest.approx(expected)
    assert met["actor/pos_lm_loss"] == pytest.approx(expected)
    assert met["actor/pos_lm_token_frac"] == pytest.approx(5 / 7)


def test_positive_lm_loss_is_zero_without_positive_episodes():
    logp = LOGP.clone().requires_grad_()
    loss, met = positive_lm_loss(logp, MASK, torch.zeros(3, dtype=torch.bool))
    loss.backward()
    assert float(loss.detach()) == 0.0 and met["actor/pos_lm_token_frac"] == 0.0
    assert torch.equal(logp.grad, torch.zeros_like(LOGP))


def test_positive_lm_gradient_only_through_positive_action_tokens():
    """d loss / d logp = −1/N at positive episodes' action tokens, exactly 0 elsewhere; garbage
    (NaN, ±inf) anywhere else changes neither the loss nor the gradient."""
    positive = torch.tensor([True, False, True])
    counted = MASK & positive.unsqueeze(1)
    clean = LOGP.clone().requires_grad_()
    loss, _ = positive_lm_loss(clean, MASK, positive)
    loss.backward()
    expected = torch.where(counted, -1.0 / 5, 0.0)
    assert torch.equal(clean.grad, expected)
    dirty = torch.where(counted, LOGP, torch.tensor([float("nan"), float("inf"), -float("inf"), 7.0]))
    dirty.requires_grad_()
    loss_d, _ = positive_lm_loss(dirty, MASK, positive)
    loss_d.backward()
    assert torch.equal(loss_d.detach(), loss.detach()) and torch.equal(dirty.grad, expected)


def test_positive_lm_loss_micro_batches_sum_to_the_batch_loss():
    positive = torch.tensor([True, False, True])
    den = copc.batch_denominators(MASK & positive.unsqueeze(1))
    for mode in copc.LOSS_AGG_MODES:
        full, _ = positive_lm_loss(LOGP, MASK, positive, loss_agg_mode=mode)
        parts = sum(float(positive_lm_loss(LOGP[i:i + 1], MASK[i:i + 1], positive[i:i + 1],
                                           loss_agg_mode=mode, denominators=den)[0]) for i in range(3))
        assert parts == pytest.approx(float(full), abs=1e-6)


def test_positive_lm_loss_bad_inputs():
    with pytest.raises(TypeError, match="positive"):
        positive_lm_loss(LOGP, MASK, torch.tensor([1, 0, 1]))
    with pytest.raises(ValueError, match=r"positive must have shape \(3,\)"):
        positive_lm_loss(LOGP, MASK, torch.tensor([True, False]))
    nan = LOGP.clone()
    nan[2, 1] = float("nan")
    with pytest.raises(ValueError, match=r"logp\[2, 1\]"):
        positive_lm_loss(nan, MASK, torch.tensor([True, False, True]))
    with pytest.raises(ValueError, match="loss_agg_mode"):
        positive_lm_loss(LOGP, MASK, torch.tensor([True, False, True]), loss_agg_mode="mean")


# -- AlgorithmConfig ----------------------------------------------------------------------------

def test_vapo_options_are_off_by_default_in_every_preset():
    for name in copc.PRESET_NAMES:
        cfg = copc.get_preset(name)
        assert (cfg.critic_lam, cfg.length_adaptive_alpha, cfg.pos_lm_coef, cfg.critic_warmup_mc_returns) \
            == (None, None, 0.0, False)
        assert cfg.pos_lm_reward_threshold == 0.5


@pytest.mark.parametrize("field, value, match", [
    ("critic_lam", 1.5, "critic_lam must be in"),
    ("critic_lam", "1", "critic_lam must be a number"),
    ("length_adaptive_alpha", 0.0, "length_adaptive_alpha must be > 0"),
    ("length_adaptive_alpha", float("nan"), "length_adaptive_alpha must be > 0"),
    ("pos_lm_coef", -0.1, "pos_lm_coef must be a finite number >= 0"),
    ("pos_lm_coef", math.inf, "pos_lm_coef must be a finite number >= 0"),
    ("pos_lm_coef", None, "pos_lm_coef must be a number"),
    ("pos_lm_reward_threshold", math.nan, "pos_lm_reward_threshold must be finite"),
    ("pos_lm_reward_threshold", "high", "pos_lm_reward_threshold must be a number"),
    ("critic_warmup_mc_returns", "yes", "critic_warmup_mc_returns must be a bool"),
])
def test_vapo_option_validation_names_the_field(field, value, match):
    with pytest.raises(ValueError, match=match):
        copc.get_preset("ppo_async", **{field: value})


@pytest.mark.parametrize("field, value", [("critic_lam", 1.0), ("length_adaptive_alpha", 0.05),
                                          ("critic_warmup_mc_returns", True)])
def test_critic_options_need_a_critic(field, value):
    with pytest.raises(ValueError, match=f"^{field}=.*needs a critic.*'grpo'"):
        copc.get_preset("dapo", **{field: value})
    copc.get_preset("copc", **{field: value})  # fine with a critic


def test_positive_lm_loss_works_for_critic_free_presets():
    assert copc.get_preset("dapo", pos_lm_coef=0.1).pos_lm_coef == 0.1
