"""Policy losses: DIS mask semantics and gradients, PPO family against hand computations."""

from __future__ import annotations

import math

import pytest
import torch

import copc

F64 = torch.float64


def batch(seed: int = 0, B: int = 4, T: int = 12, spread: float = 0.3):
    g = torch.Generator().manual_seed(seed)
    mask = torch.rand(B, T, generator=g) < 0.7
    mask[:, 0] = True
    logp_mu = -torch.rand(B, T, generator=g, dtype=F64) * 2
    logp = (logp_mu + spread * torch.randn(B, T, generator=g, dtype=F64)).requires_grad_(True)
    adv = torch.randn(B, T, generator=g, dtype=F64)
    return logp, logp_mu, adv, mask


def test_dis_with_huge_margins_is_unclipped_objective():
    logp, logp_mu, adv, mask = batch()
    loss, _ = copc.dis_policy_loss(logp, logp_mu, adv, mask, eta_p=1.0, eps_low=1.0, eps_high=1e9)
    rho = (logp - logp_mu).exp()
    per_seq = torch.where(mask, -rho * adv, 0.0).sum(1) / mask.sum(1)
    torch.testing.assert_close(loss, per_seq.mean(), atol=1e-12, rtol=0)


@pytest.mark.parametrize("mode", copc.LOSS_AGG_MODES)
def test_dis_gradient_is_rho_grad_logpi_times_advantage_on_kept_tokens(mode):
    logp, logp_mu, adv, mask = batch(spread=0.4)
    loss, metrics = copc.dis_policy_loss(logp, logp_mu, adv, mask, loss_agg_mode=mode)
    loss.backward()
    rho = (logp.detach() - logp_mu).exp()
    keep = (rho > 0.8) & (rho < 1.28) & mask
    assert 0 < keep.sum() < mask.sum(), "test batch must have both kept and masked tokens"
    n_tok = mask.sum(1, keepdim=True).to(F64)
    n_seq = float((mask.sum(1) > 0).sum())
    scale = {"token-mean": torch.full_like(n_tok, 1.0 / float(mask.sum())),
             "seq-mean-token-mean": 1.0 / (n_tok * n_seq),
             "seq-mean-token-sum": torch.full_like(n_tok, 1.0 / n_seq)}[mode]
    # d/dlogp of -ρ·Â is -ρ·Â (since dρ/dlogp = ρ): the ρ ∇log π · Â update, masked tokens 0
    expected = torch.where(keep, -rho * adv * scale, 0.0)
    torch.testing.assert_close(logp.grad, expected, atol=1e-12, rtol=0)
    masked = mask & ~keep
    assert metrics["actor/dis_masked_frac"] == pytest.approx(float(masked.sum()) / float(mask.sum()))


def test_dis_bounds_are_strict():
    mask = torch.ones(1, 3, dtype=torch.bool)
    logp_mu = torch.zeros(1, 3, dtype=F64)
    # eta_p = 0 → interval (1, 1): ρ = 1 exactly is outside, so every token is masked
    logp = torch.zeros(1, 3, dtype=F64, requires_grad=True)
    adv = torch.ones(1, 3, dtype=F64)
    loss, m = copc.dis_policy_loss(logp, logp_mu, adv, mask, eta_p=0.0)
    loss.backward()
    assert loss.item() == 0.0 and m["actor/dis_masked_frac"] == 1.0
    assert (logp.grad == 0).all()
    # ρ exactly at ℓ = 0.5 and u = 2 (eta 1, eps 0.5 / 1.0) is masked; just inside is kept
    lo, hi = copc.margins(1.0, 0.5, 1.0)
    assert (lo, hi) == (0.5, 2.0)
    log_r = torch.tensor([[math.log(0.5), math.log(2.0), math.log(1.5)]], dtype=F64)
    assert torch.equal(log_r.exp(), torch.tensor([[0.5, 2.0, 1.5]], dtype=F64))
    logp = log_r.clone().requires_grad_(True)
    loss, m = copc.dis_policy_loss(logp, logp_mu, adv, mask, eta_p=1.0, eps_low=0.5, eps_high=1.0)
    assert m["actor/dis_masked_low_frac"] == pytest.approx(1 / 3)
    assert m["actor/dis_masked_high_frac"] == pytest.approx(1 / 3)
    assert loss.item() == pytest.approx(-1.5 / 3)


def _garbage(x: torch.Tensor, g: torch.Generator) -> torch.Tensor:
    specials = torch.tensor([float("nan"), float("inf"), -float("inf"), 1e30], dtype=x.dtype)
    return specials[torch.randint(0, 4, x.shape, generator=g)]


LOSSES = {
    "dis": lambda lp, old, mu, a, m: copc.dis_policy_loss(lp, mu, a, m),
    "dis_ppo": lambda lp, old, mu, a, m: copc.dis_policy_loss(lp, mu, a, m, logp_old=old, ppo_clip_eps=0.2),
    "ppo": lambda lp, old, mu, a, m: copc.ppo_clip_policy_loss(lp, old, a, m, dual_clip_c=3.0),
    "decoupled": lambda lp, old, mu, a, m: copc.decoupled_ppo_policy_loss(lp, old, mu, a, m),
    "tis": lambda lp, old, mu, a, m: copc.tis_policy_loss(lp, old, mu, a, m),
    "icepop": lambda lp, old, mu, a, m: copc.icepop_policy_loss(lp, old, mu, a, m),
}


@pytest.mark.parametrize("name", sorted(LOSSES))
def test_garbage_at_mask0_changes_neither_loss_nor_gradient(name):
    g = torch.Generator().manual_seed(1)
    logp, logp_mu, adv, mask = batch(seed=2)
    logp_old = logp.detach() + 0.1 * torch.randn(logp.shape, generator=g, dtype=F64)
    fn = LOSSES[name]
    lp1 = logp.detach().clone().requires_grad_(True)
    loss1, _ = fn(lp1, logp_old, logp_mu, adv, mask)
    loss1.backward()
    dirty = [torch.where(mask, t, _garbage(t, g)) for t in (logp.detach(), logp_old, logp_mu, adv)]
    lp2 = dirty[0].clone().requires_grad_(True)
    loss2, _ = fn(lp2, dirty[1], dirty[2], dirty[3], mask)
    loss2.backward()
    assert torch.equal(loss1, loss2)
    assert torch.equal(lp1.grad, lp2.grad)
    assert torch.isfinite(lp2.grad).all()


def test_dis_logp_mu_minus_inf_is_masked_without_nan():
    logp, logp_mu, adv, mask = batch()
    logp_mu = logp_mu.clone()
    logp_mu[0, 0] = -math.inf
    loss, m = copc.dis_policy_loss(logp, logp_mu, adv, mask)
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(logp.grad).all()
    assert logp.grad[0, 0] == 0.0
    assert m["actor/dis_masked_high_frac"] > 0


def test_nan_advantage_at_action_token_raises():
    logp, logp_mu, adv, mask = batch()
    adv = adv.clone()
    adv[0, 0] = float("nan")
    with pytest.raises(ValueError, match=r"advantages\[0, 0\] = nan"):
        copc.dis_policy_loss(logp, logp_mu, adv, mask)


def test_ppo_clip_hand_computed():
    mask = torch.ones(1, 4, dtype=torch.bool)
    ratio = torch.tensor([[1.5, 0.5, 1.1, 0.1]], dtype=F64)
    adv = torch.tensor([[1.0, 1.0, -2.0, -1.0]], dtype=F64)
    logp_old = torch.zeros(1, 4, dtype=F64)
    logp = ratio.log().requires_grad_(True)
    loss, m = copc.ppo_clip_policy_loss(logp, logp_old, adv, mask, clip_low=0.2, clip_high=0.28,
                                        loss_agg_mode="token-mean")
    # per token max(-A r, -A clip(r, 0.8, 1.28)): [-1.28, -0.5, 2.2, 0.8]
    assert loss.item() == pytest.approx((-1.28 - 0.5 + 2.2 + 0.8) / 4)
    assert m["actor/pg_clipfrac"] == pytest.approx(2 / 4)  # tokens 0 and 3
    # dual clip c = 3 caps the loss of negative-advantage tokens at -c·A = 3|A|
    big = torch.tensor([[1.0, 1.0, 5.0, 1.0]], dtype=F64).log()
    loss_d, md = copc.ppo_clip_policy_loss(big, logp_old, adv, mask, dual_clip_c=3.0,
                                           loss_agg_mode="token-mean")
    # token 2: max(-(-2)*5, -(-2)*1.2) = 10 → capped at 6
    assert loss_d.item() == pytest.approx((-1 - 1 + 6 + 1) / 4)
    assert md["actor/pg_dual_clipfrac"] == pytest.approx(1 / 4)


def test_decoupled_ppo_equals_ppo_when_proximal_is_behavior():
    logp, logp_mu, adv, mask = batch(seed=3)
    a, _ = copc.decoupled_ppo_policy_loss(logp, logp_mu, logp_mu, adv, mask)
    b, _ = copc.ppo_clip_policy_loss(logp, logp_mu, adv, mask)
    torch.testing.assert_close(a, b, atol=1e-14, rtol=0)


def test_decoupled_ppo_behavior_weight_and_cap():
    mask = torch.ones(1, 3, dtype=torch.bool)
    adv = torch.ones(1, 3, dtype=F64)
    logp = torch.zeros(1, 3, dtype=F64, requires_grad=True)
    logp_prox = torch.zeros(1, 3, dtype=F64)
    w = torch.tensor([[0.5, 2.0, 10.0]], dtype=F64)
    logp_mu = -w.log()  # π_prox/µ = w
    loss, m = copc.decoupled_ppo_policy_loss(logp, logp_prox, logp_mu, adv, mask, behav_weight_cap=5.0,
                                             loss_agg_mode="token-mean")
    # ratio π/π_prox = 1 → per-token -A·w, token 2 dropped (w = 10 > cap), denominator stays 3
    assert loss.item() == pytest.approx(-(0.5 + 2.0) / 3)
    assert m["actor/behav_capped_frac"] == pytest.approx(1 / 3)
    loss_t, _ = copc.decoupled_ppo_policy_loss(logp, logp_prox, logp_mu, adv, mask, behav_weight_cap=5.0,
                                               behav_cap_mode="truncate", loss_agg_mode="token-mean")
    assert loss_t.item() == pytest.approx(-(0.5 + 2.0 + 5.0) / 3)


def test_tis_and_icepop_weights():
    mask = torch.ones(1, 3, dtype=torch.bool)
    adv = torch.ones(1, 3, dtype=F64)
    logp = torch.zeros(1, 3, dtype=F64, requires_grad=True)
    logp_old = torch.zeros(1, 3, dtype=F64)
    k = torch.tensor([[0.25, 1.5, 8.0]], dtype=F64)
    logp_mu = -k.log()  # π_old/µ = k
    tis, mt = copc.tis_policy_loss(logp, logp_old, logp_mu, adv, mask, tis_cap=2.0,
                                   loss_agg_mode="token-mean")
    assert tis.item() == pytest.approx(-(0.25 + 1.5 + 2.0) / 3)
    assert mt["actor/tis_truncated_frac"] == pytest.approx(1 / 3)
    ice, mi = copc.icepop_policy_loss(logp, logp_old, logp_mu, adv, mask, icepop_low=0.5,
                                      icepop_high=5.0, loss_agg_mode="token-mean")
    assert ice.item() == pytest.approx(-1.5 / 3)
    assert mi["actor/icepop_masked_frac"] == pytest.approx(2 / 3)


def test_policy_loss_parameter_errors():
    logp, logp_mu, adv, mask = batch()
    with pytest.raises(ValueError, match="loss_agg_mode must be one of"):
        copc.dis_policy_loss(logp, logp_mu, adv, mask, loss_agg_mode="mean")
    with pytest.raises(ValueError, match="ppo_clip_eps is set but logp_old is None"):
        copc.dis_policy_loss(logp, logp_mu, adv, mask, ppo_clip_eps=0.2)
    with pytest.raises(ValueError, match="dual_clip_c must be > 1"):
        copc.ppo_clip_policy_loss(logp, logp_mu, adv, mask, dual_clip_c=0.5)
    with pytest.raises(ValueError, match="logp_mu has shape"):
        copc.dis_policy_loss(logp, logp_mu[:, :3], adv, mask)
    with pytest.raises(ValueError, match="behav_cap_mode"):
        copc.decoupled_ppo_policy_loss(logp, logp_mu, logp_mu, adv, mask, behav_cap_mode="clip")
