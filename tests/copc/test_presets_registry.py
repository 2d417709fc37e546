"""Presets (the spec's baseline table), validation, and dispatch by name."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import copc
from seams.registry import Registry

TABLE = {  # spec "Baselines the paper compares": (policy loss, advantage estimator, critic)
    "ppo": ("ppo", "gae", True),
    "ppo_async": ("ppo", "gae", True),
    "areal": ("decoupled_ppo", "gae", True),
    "sao": ("dis", "batch_norm", False),
    "sao_critic": ("dis", "gae", True),
    "vtrace": ("ppo", "vtrace", True),
    "dapo": ("ppo", "grpo", False),
    "brace": ("ppo", "brace", True),
    "copc_wo_rc": ("dis", "copc", True),
    "copc": ("dis", "copc", True),
}


@pytest.mark.parametrize("name", sorted(TABLE))
def test_presets_match_the_spec_table(name):
    p = copc.get_preset(name)
    assert (p.policy_loss, p.advantage_estimator, p.use_critic) == TABLE[name]
    assert p.name == name
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.gamma = 0.1  # type: ignore[misc]


def test_preset_specific_values():
    c = copc.get_preset("copc")
    e, p = c.estimator_settings, c.policy_loss_settings  # moved: CopcSettings, DisSettings
    assert (p.eta_p, e.eta_a, c.eps_low, c.eps_high, c.gamma, c.lam) == (0.5, 0.5, 0.4, 0.56, 1.0, 1.0)
    assert p.ppo_clip_eps is None and not c.normalize_advantages
    assert c.loss_agg_mode == "seq-mean-token-mean"
    assert copc.get_preset("copc_wo_rc").estimator_settings.eta_a == 0.0
    d = copc.get_preset("dapo")
    assert (d.policy_loss_settings.clip_low, d.policy_loss_settings.clip_high, d.loss_agg_mode) == \
        (0.2, 0.28, "token-mean")
    v = copc.get_preset("vtrace").estimator_settings
    assert (v.rho_clip, v.c_clip) == (1.0, 1.0)
    b = copc.get_preset("brace")
    s = b.estimator_settings
    assert (s.rho_clip, s.c_clip, b.value_clip_eps, s.horizon) == (1.2, 1.1, 0.5, 100)
    assert copc.get_preset("brace", estimator_settings={"horizon": 7}).estimator_settings.horizon == 7
    with pytest.raises(ValueError, match="horizon must be an int >= 1"):
        copc.get_preset("brace", estimator_settings={"horizon": 0})
    assert set(copc.PRESET_NAMES) == set(TABLE)


@pytest.mark.parametrize("overrides,match", [
    ({"estimator_settings": {"eta_a": 1.5}}, r"estimator_settings\.eta_a=1\.5: must be a number in \[0, 1\]"),
    ({"gamma": -0.1}, "gamma must be in"),
    ({"loss_agg_mode": "sum"}, "loss_agg_mode must be one of"),
    ({"policy_loss": "reinforce"}, "policy_loss must be one of"),
    ({"advantage_estimator": "gae", "use_critic": False}, "use_critic=False is incompatible"),
    ({"policy_loss": "ppo", "policy_loss_settings": {"clip_low": 1.0}},
     r"clip_low=1\.0: must be a number in \(0"),
    ({"policy_loss": "ppo", "policy_loss_settings": {"dual_clip_c": 1.0}},
     "dual_clip_c=1.0: must be a number > 1"),
    ({"max_staleness": -1}, "max_staleness: left the algorithm"),
    ({"obs_reward": "drop"}, "obs_reward must be one of"),
    ({"etaa": 0.5}, r"unknown AlgorithmConfig field\(s\) \['etaa'\]"),
])
def test_invalid_overrides_name_the_field(overrides, match):
    with pytest.raises(ValueError, match=match):
        copc.get_preset("copc", **overrides)


def test_unknown_preset():
    with pytest.raises(ValueError, match=r"unknown preset 'grpo'.*available"):
        copc.get_preset("grpo")


def test_registry_errors_and_custom_registration():
    with pytest.raises(ValueError, match="unknown policy loss 'nope'; known"):
        copc.POLICY_LOSSES.get("nope")
    reg = Registry("thing")
    reg.register("a")(len)
    assert reg.get("a") is len and "a" in reg and reg.names() == ["a"]
    with pytest.raises(ValueError, match="already registered"):
        reg.register("a")(len)


def _inputs(g: torch.Generator, B: int = 6, T: int = 20):
    mask = torch.rand(B, T, generator=g) < 0.7
    mask[:, 0] = True
    rewards = torch.zeros(B, T)
    scores = (torch.rand(B, generator=g) > 0.5).float()
    last = T - 1 - mask.flip(1).float().argmax(1)
    rewards[torch.arange(B), last] = scores
    logp_old = -torch.rand(B, T, generator=g)
    return copc.AdvantageInputs(
        rewards=rewards, loss_mask=mask, values=torch.randn(B, T, generator=g), logp_old=logp_old,
        logp_mu=logp_old + 0.3 * torch.randn(B, T, generator=g), scores=scores,
        group_ids=torch.arange(B) // 2)


@pytest.mark.parametrize("name", sorted(TABLE))
def test_every_preset_runs_end_to_end_by_name(name):
    g = torch.Generator().manual_seed(0)
    cfg = copc.get_preset(name)
    x = _inputs(g)
    adv, ret = copc.compute_advantages(x, cfg)
    assert adv.shape == x.loss_mask.shape and torch.isfinite(adv).all() and torch.isfinite(ret).all()
    assert (adv[~x.loss_mask] == 0).all()
    logp = (x.logp_old + 0.05 * torch.randn(x.logp_old.shape, generator=g)).requires_grad_(True)
    loss, metrics = copc.compute_policy_loss(
        logp, copc.PolicyLossInputs(x.logp_old, x.logp_mu, adv, x.loss_mask), cfg)
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(logp.grad).all()
    assert logp.grad.abs().sum() > 0
    assert all(k.startswith(("actor/", "behav/")) for k in metrics)


def test_registry_dispatch_equals_direct_call():
    g = torch.Generator().manual_seed(1)
    x = _inputs(g)
    cfg = copc.get_preset("copc", gamma=0.99, lam=0.95, estimator_settings={"eta_a": 0.25})
    a1 = copc.compute_advantages(x, cfg)
    a2 = copc.coupled_advantage_return(x.rewards, x.values, x.logp_old, x.logp_mu, x.loss_mask,
                                       gamma=0.99, lam=0.95, eta_a=0.25)
    assert torch.equal(a1[0], a2[0]) and torch.equal(a1[1], a2[1])


def test_missing_inputs_are_named():
    g = torch.Generator().manual_seed(2)
    x = _inputs(g)
    x.logp_mu = None
    with pytest.raises(ValueError, match=r"'copc' needs \['logp_mu'\]"):
        copc.compute_advantages(x, copc.get_preset("copc"))


def test_group_relative_advantages_hand_computed():
    scores = torch.tensor([1.0, 0.0, 1.0, 1.0, 0.5])
    groups = torch.tensor([7, 7, 3, 3, 9])
    adv = copc.group_relative_advantages(scores, groups, eps=0.0 + 1e-12)
    s = torch.tensor([1.0, 0.0]).std()  # unbiased, as torch.std
    torch.testing.assert_close(adv[:2], torch.tensor([0.5, -0.5]) / s)
    assert adv[2:].abs().max() < 1e-6 and adv[4] == 0.0  # constant group, singleton group
    adv_nc = copc.group_relative_advantages(scores, groups, std_normalize=False)
    torch.testing.assert_close(adv_nc, torch.tensor([0.5, -0.5, 0.0, 0.0, 0.0]))
    with pytest.raises(ValueError, match="integer"):
        copc.group_relative_advantages(scores, groups.float())
    with pytest.raises(ValueError, match=r"scores\[1\] = nan"):
        copc.group_relative_advantages(torch.tensor([1.0, float("nan")]), torch.tensor([0, 0]))


def test_batch_normalized_and_broadcast():
    scores = torch.tensor([1.0, 0.0, 0.0, 1.0])
    adv = copc.batch_normalized_advantages(scores)
    s = scores.std()
    torch.testing.assert_close(adv, (scores - 0.5) / (s + 1e-6))
    mask = torch.tensor([[1, 0], [1, 1], [0, 0], [0, 1]], dtype=torch.bool)
    tok = copc.broadcast_to_tokens(adv, mask)
    assert tok[0, 1] == 0 and tok[1, 1] == adv[1] and tok[3, 1] == adv[3] and (tok[2] == 0).all()
