"""The built-in estimators and policy losses own their settings (copc/component_settings.py), as a
user's plug-in does: registered with the registry, filled by the presets, merged with overrides,
and the old central fields refused with one line naming the new spelling."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import copc
from copc.component_settings import (
    CopcSettings,
    DecoupledPpoSettings,
    DisSettings,
    GrpoSettings,
    IcePopSettings,
    PPOClip,
    TisSettings,
    VTraceSettings,
)
from copc.presets import MOVED_FIELDS

BUILT_IN = {
    ("estimator", "copc"): CopcSettings, ("estimator", "vtrace"): VTraceSettings,
    ("estimator", "brace"): copc.BraceSettings, ("estimator", "grpo"): GrpoSettings,
    ("estimator", "gae"): None, ("estimator", "batch_norm"): None,
    ("loss", "dis"): DisSettings, ("loss", "ppo"): PPOClip, ("loss", "decoupled_ppo"): DecoupledPpoSettings,
    ("loss", "tis"): TisSettings, ("loss", "icepop"): IcePopSettings,
}


@pytest.mark.parametrize("kind,name", sorted(BUILT_IN))
def test_every_built_in_registers_its_settings_class(kind, name):
    reg = copc.ADVANTAGE_ESTIMATORS if kind == "estimator" else copc.POLICY_LOSSES
    assert reg.settings_type(name) is BUILT_IN[(kind, name)]


def test_the_ppo_family_shares_ppo_clip_and_brace_extends_vtrace():
    for cls in (DecoupledPpoSettings, TisSettings, IcePopSettings):
        assert issubclass(cls, PPOClip)
        assert {f.name for f in dataclasses.fields(PPOClip)} <= {f.name for f in dataclasses.fields(cls)}
    assert issubclass(copc.BraceSettings, VTraceSettings)
    brace_fields = [f.name for f in dataclasses.fields(copc.BraceSettings)]
    assert brace_fields == ["rho_clip", "c_clip", "horizon", "tail"]


def test_the_central_config_keeps_only_cross_cutting_fields():
    fields = {f.name for f in dataclasses.fields(copc.AlgorithmConfig)}
    assert not fields & set(MOVED_FIELDS) and "max_staleness" not in fields
    assert len(fields) == 22  # was 37 before the built-ins owned their settings


@pytest.mark.parametrize("old", sorted(MOVED_FIELDS))
def test_an_old_field_is_refused_naming_its_new_spelling(old):
    new, where = MOVED_FIELDS[old]
    with pytest.raises(ValueError, match=rf"^{old}: moved to {new} \(with {where.replace('|', '[|]')}\)$"):
        copc.get_preset("copc", **{old: 0.5})
    with pytest.raises(ValueError, match=rf"^{old}: moved to {new} "):
        copc.get_preset("copc").replace(**{old: 0.5})


def test_preset_settings_merge_with_overrides_of_the_same_component():
    b = copc.get_preset("brace", estimator_settings={"horizon": 7})
    s = b.estimator_settings
    assert (s.horizon, s.rho_clip, s.c_clip) == (7, 1.2, 1.1)
    d = copc.get_preset("dapo", policy_loss_settings={"dual_clip_c": 3.0})
    assert (d.policy_loss_settings.clip_low, d.policy_loss_settings.clip_high,
            d.policy_loss_settings.dual_clip_c) == (0.2, 0.28, 3.0)
    c = copc.get_preset("copc_wo_rc", policy_loss_settings={"ppo_clip_eps": 0.3})
    p = c.policy_loss_settings
    assert (c.estimator_settings.eta_a, p.eta_p, p.ppo_clip_eps) == (0.0, 0.5, 0.3)


def test_naming_another_component_drops_the_presets_settings_for_it():
    c = copc.get_preset("brace", advantage_estimator="vtrace")  # brace's ρ̄ = 1.2 is not vtrace's
    assert c.estimator_settings == VTraceSettings(1.0, 1.0)
    c = copc.get_preset("copc", policy_loss="ppo")
    assert c.policy_loss_settings == PPOClip() and c.estimator_settings == CopcSettings(0.5)
    r = copc.get_preset("brace").replace(advantage_estimator="gae")
    assert r.estimator_settings is None
    with pytest.raises(ValueError, match=r"policy_loss_settings\.eta_p=0\.5: unknown setting of PPOClip"):
        copc.get_preset("copc", policy_loss="ppo", policy_loss_settings={"eta_p": 0.5})


def test_the_settings_reach_the_estimator_and_the_loss():
    """η_A / ρ̄ / the clip read from the settings give what the direct call with those values gives."""
    g = torch.Generator().manual_seed(3)
    B, T = 4, 9
    mask = torch.ones(B, T, dtype=torch.bool)
    r = torch.zeros(B, T)
    r[:, -1] = torch.rand(B, generator=g)
    v, lo, lm = torch.randn(B, T, generator=g), -torch.rand(B, T, generator=g), -torch.rand(B, T, generator=g)
    x = copc.AdvantageInputs(rewards=r, loss_mask=mask, values=v, logp_old=lo, logp_mu=lm)
    got = copc.compute_advantages(x, copc.get_preset("copc", estimator_settings={"eta_a": 0.25}))
    want = copc.coupled_advantage_return(r, v, lo, lm, mask, eta_a=0.25)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert not torch.equal(got[0], copc.coupled_advantage_return(r, v, lo, lm, mask, eta_a=0.5)[0])
    got = copc.compute_advantages(x, copc.get_preset("vtrace", estimator_settings={"rho_clip": 0.9}))
    want = copc.vtrace_advantage_return(r, v, lo, lm, mask, rho_clip=0.9, c_clip=1.0)
    assert torch.equal(got[0], want[0])
    adv = torch.randn(B, T, generator=g)
    logp = lo + 0.4 * torch.randn(B, T, generator=g)
    inputs = copc.PolicyLossInputs(logp_old=lo, logp_mu=lm, advantages=adv, loss_mask=mask)
    loss, _ = copc.compute_policy_loss(logp, inputs, copc.get_preset(
        "ppo_async", policy_loss="tis", policy_loss_settings={"clip_high": 0.28, "tis_cap": 1.5}))
    ref, _ = copc.tis_policy_loss(logp, lo, lm, adv, mask, clip_high=0.28, tis_cap=1.5)
    assert torch.equal(loss, ref)


def test_a_null_settings_override_keeps_the_presets_own_and_name_relabels():
    """``estimator_settings: null`` (or ``{}``) is no change: ``copc_wo_rc`` stays η_A = 0 (it used
    to become plain ``copc``'s 0.5), ``brace`` keeps ρ̄ 1.2 / c̄ 1.1; ``name`` relabels the config
    (``algorithm.name=foo`` used to raise a TypeError: get_preset's own parameter is ``name``)."""
    assert copc.get_preset("copc_wo_rc", estimator_settings=None).estimator_settings.eta_a == 0.0
    brace = copc.get_preset("brace", estimator_settings={})
    assert brace.estimator_settings == copc.BraceSettings(1.2, 1.1, 100)
    named = copc.get_preset("brace", name="brace_k50", estimator_settings={"horizon": 50})
    assert (named.name, named.advantage_estimator, named.estimator_settings.rho_clip) == \
        ("brace_k50", "brace", 1.2)


@pytest.mark.parametrize("preset,settings,owner", [
    ("copc", {"policy_loss_settings": {"clip_high": 0.28}},
     "policy_loss: ppo | decoupled_ppo | tis | icepop"),
    ("ppo_async", {"policy_loss_settings": {"eta_p": 0.3}}, "policy_loss: dis"),
    ("vtrace", {"estimator_settings": {"eta_a": 0.3}}, "advantage_estimator: copc"),
])
def test_a_knob_under_the_wrong_component_names_its_owner(preset, settings, owner):
    with pytest.raises(ValueError, match=r"unknown setting of \w+; known: \[.*\] \(\w+ is a setting of "
                                         + owner.replace("|", "[|]") + r"\)$"):
        copc.get_preset(preset, **settings)
