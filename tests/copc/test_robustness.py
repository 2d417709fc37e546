"""Regression tests from a review that tried to break copc/: edge inputs stay defined or fail clearly."""

from __future__ import annotations

import math

import pytest
import torch
from reference import coupled_reference, random_multiturn_mask

import copc

F64 = torch.float64


def batch(seed=0, B=3, T=40, dtype=F64):
    g = torch.Generator().manual_seed(seed)
    mask = random_multiturn_mask(B, T, g)
    first = torch.where(mask.any(1), mask.float().argmax(1), torch.full((B,), T))
    rewards = torch.randn(B, T, generator=g, dtype=F64) * (torch.rand(B, T, generator=g) < 0.3)
    rewards = rewards.masked_fill(torch.arange(T)[None] < first[:, None], 0.0)
    lo = -torch.rand(B, T, generator=g, dtype=F64)
    return dict(rewards=rewards.to(dtype), values=torch.randn(B, T, generator=g, dtype=F64).to(dtype),
                logp_old=lo.to(dtype),
                logp_mu=(lo + 0.3 * torch.randn(B, T, generator=g, dtype=F64)).to(dtype),
                loss_mask=mask)


@pytest.mark.parametrize("gamma,lam", [(0.9, 1.0), (0.95, 0.9), (1.0, 1.0)])
def test_per_token_observation_discount_matches_reference(gamma, lam):
    x = batch(1, 4, 120)
    adv, ret = copc.coupled_advantage_return(**x, gamma=gamma, lam=lam, obs_discount="per_token")
    ra, rr = coupled_reference(x["rewards"], x["values"], x["logp_old"], x["logp_mu"], x["loss_mask"],
                               gamma, lam, 0.8, 1.28, per_token=True)
    torch.testing.assert_close(adv, ra, atol=1e-10, rtol=1e-10)
    torch.testing.assert_close(ret, rr, atol=1e-10, rtol=1e-10)
    if gamma * lam < 1:
        skip = copc.coupled_advantage_return(**x, gamma=gamma, lam=lam)
        assert not torch.allclose(skip[1], ret)


def test_inputs_with_grad_are_detached_in_all_estimators():
    x = batch()
    x["values"] = x["values"].clone().requires_grad_(True)
    for fn in (copc.coupled_advantage_return, copc.vtrace_advantage_return):
        adv, ret = fn(**x)
        assert not adv.requires_grad and not ret.requires_grad
    adv, _ = copc.gae_advantage_return(x["rewards"], x["values"], x["loss_mask"])
    assert not adv.requires_grad


def test_transposed_and_strided_inputs():
    x = batch()
    ref = copc.coupled_advantage_return(**x)
    y = dict(x)
    y["rewards"] = x["rewards"].t().contiguous().t()
    y["values"] = torch.stack([x["values"][:, i] for i in range(x["values"].shape[1])], 1)
    out = copc.coupled_advantage_return(**y)
    assert torch.equal(out[0], ref[0]) and torch.equal(out[1], ref[1])
    _ = copc.vtrace_advantage_return(**y)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_is_computed_in_float32(dtype):
    x = batch(2, 2, 300, dtype)
    adv, ret = copc.coupled_advantage_return(**x, lam=0.1)
    assert adv.dtype == torch.float32
    _, rr = coupled_reference(*(x[k].double() for k in ("rewards", "values", "logp_old", "logp_mu")),
                               x["loss_mask"], 1.0, 0.1, 0.8, 1.28)
    torch.testing.assert_close(ret.double(), rr, atol=1e-4, rtol=1e-4)


def test_empty_time_dimension():
    x = {k: v[:, :0] for k, v in batch().items()}
    adv, ret = copc.coupled_advantage_return(**x)
    assert adv.shape == (3, 0) and ret.shape == (3, 0)
    assert copc.vtrace_advantage_return(**x)[0].shape == (3, 0)


def test_error_names_bootstrap_and_observation_rewards():
    x = batch()
    with pytest.raises(ValueError, match=r"bootstrap_values\[1\] = nan"):
        copc.gae_advantage_return(x["rewards"], x["values"], x["loss_mask"],
                                  bootstrap_values=torch.tensor([0.0, math.nan, 0.0], dtype=F64))
    m = x["loss_mask"]
    b, t = (int(i) for i in (~m).nonzero()[-1])
    assert m[b, :t].any(), "need an observation token after an action token"
    x["rewards"] = x["rewards"].clone()
    x["rewards"][b, t] = math.inf
    with pytest.raises(ValueError, match=rf"rewards\[{b}, {t}\] = inf"):
        copc.coupled_advantage_return(**x)


def test_hyperparameters_must_be_numbers():
    x = batch()
    with pytest.raises(ValueError, match="gamma must be a number"):
        copc.coupled_advantage_return(**x, gamma="0.9")
    with pytest.raises(ValueError, match="eta must be a number"):
        copc.coupled_advantage_return(**x, eta_a=None)
    with pytest.raises(ValueError, match="obs_discount must be one of"):
        copc.gae_advantage_return(x["rewards"], x["values"], x["loss_mask"], obs_discount="tokens")


def _lp(values):
    return torch.tensor([values], dtype=F64, requires_grad=True)


def test_icepop_infinite_weight_has_zero_not_nan_gradient():
    lp = _lp([-1.0, -1.0])
    lo = torch.full((1, 2), -1.0, dtype=F64)
    mu = lo.clone()
    mu[0, 0] = -math.inf
    loss, _ = copc.icepop_policy_loss(lp, lo, mu, torch.ones(1, 2, dtype=F64),
                                      torch.ones(1, 2, dtype=torch.bool))
    loss.backward()
    assert lp.grad.tolist() == [[0.0, -0.5]]


@pytest.mark.parametrize("name", ["ppo", "decoupled", "tis", "icepop", "dis_ppo"])
def test_overflowing_log_ratio_gives_finite_gradient(name):
    lp = torch.tensor([[-1.0, -1.0]], requires_grad=True)
    lo = torch.tensor([[-200.0, -1.0]])
    mu, adv, m = lo.clone(), torch.tensor([[1.0, -1.0]]), torch.ones(1, 2, dtype=torch.bool)
    fn = {"ppo": lambda: copc.ppo_clip_policy_loss(lp, lo, adv, m),
          "decoupled": lambda: copc.decoupled_ppo_policy_loss(lp, lo, mu, adv, m),
          "tis": lambda: copc.tis_policy_loss(lp, lo, mu, adv, m),
          "icepop": lambda: copc.icepop_policy_loss(lp, lo, mu, adv, m),
          "dis_ppo": lambda: copc.dis_policy_loss(lp, mu - 0.1, adv, m, logp_old=lo, ppo_clip_eps=0.2)}[name]
    loss, metrics = fn()
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(lp.grad).all()
    assert all(math.isfinite(v) for v in metrics.values())


def test_dis_nan_logp_at_action_token_raises():
    lp = _lp([math.nan, -1.0])
    with pytest.raises(ValueError, match=r"logp\[0, 0\] = nan at an action token"):
        copc.dis_policy_loss(lp, torch.zeros(1, 2, dtype=F64), torch.ones(1, 2, dtype=F64),
                             torch.ones(1, 2, dtype=torch.bool))


def test_config_types_and_incoherent_choices():
    with pytest.raises(ValueError, match="gamma must be a number"):
        copc.get_preset("copc", gamma="0.9")
    with pytest.raises(ValueError, match="gamma must be a number"):
        copc.get_preset("copc", gamma=True)
    with pytest.raises(ValueError, match="use_critic must be a bool"):
        copc.get_preset("copc", use_critic="no")
    with pytest.raises(ValueError, match=r"estimator_settings\.eta_a=None: must be a number"):
        copc.get_preset("copc", estimator_settings={"eta_a": None})
    with pytest.raises(ValueError, match="critic would train for nothing"):
        copc.get_preset("dapo", use_critic=True)
    with pytest.raises(ValueError, match=r"max_staleness: left the algorithm.*'ppo' preset is "
                                         r"synchronous"):
        copc.get_preset("ppo", max_staleness=8)
    with pytest.raises(ValueError, match="not supported by advantage_estimator='vtrace'"):
        copc.get_preset("vtrace", obs_discount="per_token")
    assert copc.get_preset("copc", obs_discount="per_token").obs_discount == "per_token"
