"""The registries are open: a user's estimator / loss, registered with metadata, passes config
validation and is dispatched to; the metadata (needs_critic, needs_groups) drives validation."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable

import pytest
import torch

import copc
from seams.registry import REQUIRED, LazyRef, Registry, RegistryError

BUILTIN_ESTIMATORS = ["batch_norm", "brace", "copc", "gae", "grpo", "vtrace"]
BUILTIN_LOSSES = ["decoupled_ppo", "dis", "icepop", "ppo", "tis"]


def mc_return(x: copc.AdvantageInputs, cfg: copc.AlgorithmConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """Monte-Carlo reward-to-go over action tokens, discounted by cfg.gamma per action token."""
    mask = x.loss_mask.bool()
    ret = torch.zeros_like(x.rewards)
    for b in range(x.rewards.shape[0]):
        g = 0.0
        for t in reversed(range(x.rewards.shape[1])):
            if mask[b, t]:
                g = float(x.rewards[b, t]) + cfg.gamma * g
                ret[b, t] = g
    return ret, ret.clone()


def reinforce(logp: torch.Tensor, x: copc.PolicyLossInputs, cfg: copc.AlgorithmConfig
              ) -> tuple[torch.Tensor, dict]:
    """-mean over action tokens of logp * advantage."""
    m = x.loss_mask.float()
    loss = -(logp * x.advantages * m).sum() / m.sum()
    return loss, {"actor/reinforce_loss": float(loss.detach())}


def critic_est(x: copc.AdvantageInputs, cfg: copc.AlgorithmConfig) -> tuple[torch.Tensor, torch.Tensor]:
    return x.values, x.values


@pytest.fixture
def custom():
    """Register the test's entries; always unregister them (other tests see the built-ins only)."""
    copc.ADVANTAGE_ESTIMATORS.register("mc_return", needs_critic=False)(mc_return)
    copc.ADVANTAGE_ESTIMATORS.register("values_as_adv", needs_critic=True)(critic_est)
    copc.ADVANTAGE_ESTIMATORS.register("grouped_mc", needs_critic=False, needs_groups=True)(mc_return)
    copc.POLICY_LOSSES.register("reinforce")(reinforce)
    try:
        yield
    finally:
        for name in ("mc_return", "values_as_adv", "grouped_mc"):
            copc.ADVANTAGE_ESTIMATORS.unregister(name)
        copc.POLICY_LOSSES.unregister("reinforce")


def test_builtin_metadata():
    needs = ("needs_critic", "needs_groups")
    meta = {n: {k: copc.ADVANTAGE_ESTIMATORS.metadata(n)[k] for k in needs}
            for n in copc.ADVANTAGE_ESTIMATORS.names()}
    assert meta == {
        "batch_norm": {"needs_critic": False, "needs_groups": False},
        "brace": {"needs_critic": True, "needs_groups": False},
        "copc": {"needs_critic": True, "needs_groups": False},
        "gae": {"needs_critic": True, "needs_groups": False},
        "grpo": {"needs_critic": False, "needs_groups": True},
        "vtrace": {"needs_critic": True, "needs_groups": False},
    }
    assert copc.POLICY_LOSSES.names() == BUILTIN_LOSSES
    # capabilities the trainer reads instead of comparing names: only vtrace and brace take a (B,) λ
    # in one pass and lack per-token observation discounting; only copc / dis have a channel interval
    est, loss = copc.ADVANTAGE_ESTIMATORS, copc.POLICY_LOSSES
    assert est.names(per_token_obs_discount=False) == ["brace", "vtrace"]
    assert [n for n in est.names() if est.metadata(n)["lambda_rows"] is not None] == ["brace", "vtrace"]
    assert [n for n in est.names() if est.metadata(n)["channel_margins"] is not None] == ["copc"]
    assert [n for n in loss.names() if loss.metadata(n)["channel_margins"] is not None] == ["dis"]
    cfg = copc.get_preset("copc", estimator_settings={"eta_a": 0.25}, policy_loss_settings={"eta_p": 0.5})
    assert est.metadata("copc")["channel_margins"](cfg) == copc.margins(0.25, cfg.eps_low, cfg.eps_high)
    assert loss.metadata("dis")["channel_margins"](cfg) == copc.margins(0.5, cfg.eps_low, cfg.eps_high)
    assert dict(loss.metadata("ppo")) == {"channel_margins": None}
    with pytest.raises(TypeError):  # read-only
        copc.ADVANTAGE_ESTIMATORS.metadata("gae")["needs_critic"] = False  # type: ignore[index]


def test_custom_estimator_and_loss_validate_and_dispatch(custom):
    cfg = copc.get_preset("copc", advantage_estimator="mc_return", use_critic=False,
                          policy_loss="reinforce", gamma=0.5)
    assert (cfg.advantage_estimator, cfg.policy_loss, cfg.use_critic) == ("mc_return", "reinforce", False)
    # row 0: three action tokens, reward 1 at the end: 0.25, 0.5, 1 (gamma = 0.5 per action token)
    # row 1: token 1 is an observation (skipped, 0): [0 + 0.5 * 2, 0, 2] = [1, 0, 2]
    rewards = torch.tensor([[0.0, 0.0, 1.0], [0.0, 0.0, 2.0]])
    mask = torch.tensor([[True, True, True], [True, False, True]])
    adv, ret = copc.compute_advantages(copc.AdvantageInputs(rewards=rewards, loss_mask=mask), cfg)
    torch.testing.assert_close(adv, torch.tensor([[0.25, 0.5, 1.0], [1.0, 0.0, 2.0]]))
    torch.testing.assert_close(ret, adv)

    logp = torch.tensor([[-1.0, -2.0, -0.5], [-1.0, -3.0, -0.25]], requires_grad=True)
    loss, metrics = copc.compute_policy_loss(
        logp, copc.PolicyLossInputs(logp.detach(), logp.detach(), adv, mask), cfg)
    # -(-1*.25 - 2*.5 - .5*1 - 1*1 - .25*2) / 5 = 3.25 / 5
    assert loss.item() == pytest.approx(0.65)
    assert metrics == {"actor/reinforce_loss": pytest.approx(0.65)}
    loss.backward()
    torch.testing.assert_close(logp.grad, -adv * mask / 5)


def test_registration_order_matters_and_unregister():
    with pytest.raises(ValueError, match="advantage_estimator must be one of the registered") as ei:
        copc.get_preset("copc", advantage_estimator="mc_return", use_critic=False)
    assert str(BUILTIN_ESTIMATORS) in str(ei.value) and "'mc_return'" in str(ei.value)
    copc.ADVANTAGE_ESTIMATORS.register("mc_return", needs_critic=False)(mc_return)
    try:
        assert copc.get_preset("copc", advantage_estimator="mc_return", use_critic=False).use_critic is False
        assert "mc_return" in copc.ADVANTAGE_ESTIMATORS
    finally:
        assert copc.ADVANTAGE_ESTIMATORS.unregister("mc_return") is mc_return
    assert copc.ADVANTAGE_ESTIMATORS.names() == BUILTIN_ESTIMATORS
    with pytest.raises(ValueError, match="advantage_estimator must be one of"):
        copc.get_preset("copc", advantage_estimator="mc_return", use_critic=False)
    with pytest.raises(ValueError, match="unknown advantage estimator 'mc_return'; known"):
        copc.ADVANTAGE_ESTIMATORS.unregister("mc_return")


def test_unregistered_policy_loss_lists_the_registered():
    with pytest.raises(ValueError) as ei:
        copc.get_preset("copc", policy_loss="reinforce")
    msg = str(ei.value)
    assert msg.startswith("policy_loss must be one of the registered policy losses")
    assert str(BUILTIN_LOSSES) in msg and "'reinforce'" in msg


def test_needs_critic_must_match_use_critic(custom):
    with pytest.raises(ValueError, match=r"use_critic=True with advantage_estimator='mc_return'"):
        copc.get_preset("copc", advantage_estimator="mc_return")
    with pytest.raises(ValueError, match=r"use_critic=False is incompatible with "
                                         r"advantage_estimator='values_as_adv'"):
        copc.get_preset("dapo", advantage_estimator="values_as_adv")
    assert copc.get_preset("dapo", advantage_estimator="values_as_adv", use_critic=True).use_critic


def test_needs_groups_against_n_samples_per_prompt(custom):
    # the built-in grpo and a custom group-relative estimator alike
    for est in ("grpo", "grouped_mc"):
        with pytest.raises(ValueError, match=rf"n_samples_per_prompt=1 is incompatible with "
                                             rf"advantage_estimator='{est}'"):
            copc.get_preset("dapo", advantage_estimator=est, n_samples_per_prompt=1)
        cfg = copc.get_preset("dapo", advantage_estimator=est, n_samples_per_prompt=2)
        assert cfg.n_samples_per_prompt == 2
    assert copc.get_preset("dapo").n_samples_per_prompt is None  # any group size >= 2


def test_sao_is_single_rollout():
    assert copc.get_preset("sao").n_samples_per_prompt == 1
    assert copc.get_preset("sao", n_samples_per_prompt=1).n_samples_per_prompt == 1
    with pytest.raises(ValueError, match=r"preset 'sao' is single-rollout .*\(got n_samples_per_prompt=4\)"):
        copc.get_preset("sao", n_samples_per_prompt=4)
    with pytest.raises(ValueError, match=r"got n_samples_per_prompt=None"):
        copc.get_preset("sao", n_samples_per_prompt=None)
    for p in copc.PRESET_NAMES:
        assert copc.get_preset(p).n_samples_per_prompt == (1 if p in ("sao", "sao_critic") else None), p
    with pytest.raises(ValueError, match=r"'sao_critic' is single-rollout .*\(got n_samples_per_prompt=2\)"):
        copc.get_preset("sao_critic", n_samples_per_prompt=2)


@pytest.mark.parametrize("bad", [0, -2, True, 1.5, "2"])
def test_n_samples_per_prompt_type_and_range(bad):
    with pytest.raises(ValueError, match="n_samples_per_prompt must be an int >= 1 or None"):
        copc.get_preset("copc", n_samples_per_prompt=bad)


def test_register_validates_metadata():
    reg = copc.ADVANTAGE_ESTIMATORS
    with pytest.raises(ValueError, match=r"'x': register\(\) needs metadata needs_critic=<bool>"):
        reg.register("x")
    with pytest.raises(ValueError, match=r"'x': unknown metadata \['need_critic'\]; known: "
                                         r"\['channel_margins', 'lambda_rows', 'needs_critic', "
                                         r"'needs_groups', 'per_token_obs_discount'\]"):
        reg.register("x", need_critic=False)
    with pytest.raises(ValueError, match="metadata needs_critic must be a bool, got 'yes'"):
        reg.register("x", needs_critic="yes")
    with pytest.raises(ValueError, match="metadata needs_groups must be a bool, got 1"):
        reg.register("x", needs_critic=False, needs_groups=1)
    with pytest.raises(ValueError, match="already registered"):
        reg.register("gae", needs_critic=True)(mc_return)
    with pytest.raises(ValueError, match="not callable"):
        reg.register("x", needs_critic=False)(42)
    with pytest.raises(ValueError, match="non-empty string"):
        copc.POLICY_LOSSES.register("")
    assert reg.names() == BUILTIN_ESTIMATORS and reg.get("gae") is not mc_return  # nothing leaked


def test_generic_registry_with_defaults():
    reg = Registry("thing", metadata={"size": (int, 3), "tag": (str, REQUIRED)})
    reg.register("a", tag="t")(len)
    reg.register("b", tag="u", size=7)(abs)
    assert dict(reg.metadata("a")) == {"size": 3, "tag": "t"}
    assert dict(reg.metadata("b")) == {"size": 7, "tag": "u"}
    with pytest.raises(ValueError, match=r"unknown thing 'c'; known: \['a', 'b'\]"):
        reg.metadata("c")
    assert [] not in reg  # unhashable: not a member, no TypeError


def test_lazy_entries_are_imported_on_first_get(tmp_path, monkeypatch):
    """A LazyRef entry is registered (name, metadata, settings) without importing its module; the
    first get imports it and keeps the object; a metadata LazyRef calls through."""
    (tmp_path / "lazy_mod_for_test.py").write_text("def double(x):\n    return 2 * x\n\nVALUE = 3\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    reg = Registry("thing", metadata={"hook": ((type(None), Callable), None)})
    reg.register("d", LazyRef("lazy_mod_for_test:double"), hook=LazyRef("lazy_mod_for_test:double"))
    reg.register("v", LazyRef("lazy_mod_for_test:VALUE"))
    assert reg.names() == ["d", "v"] and "lazy_mod_for_test" not in sys.modules
    assert repr(reg.metadata("d")["hook"]) == "LazyRef('lazy_mod_for_test:double')"
    assert reg.metadata("d")["hook"](21) == 42  # imports the module now
    fn = reg.get("d")
    assert fn is sys.modules["lazy_mod_for_test"].double and reg.get("d") is fn and fn(5) == 10
    with pytest.raises(RegistryError, match=r"thing 'v': lazy_mod_for_test:VALUE is 3, not callable"):
        reg.get("v")
    specs = Registry("spec", callable_entries=False)
    specs.register("v", LazyRef("lazy_mod_for_test:VALUE"))
    assert specs.get("v") == 3
    with pytest.raises(RegistryError, match=r"LazyRef\('no_colon'\): must be 'package.module:attribute'"):
        LazyRef("no_colon")
    reg.register("gone", LazyRef("lazy_mod_for_test:missing"))
    with pytest.raises(AttributeError):
        reg.get("gone")


def test_builtins_are_registered_without_torch():
    """Validating an algorithm config (names, metadata, settings of the built-ins) imports no torch."""
    code = ("import sys, copc\n"
            "cfg = copc.get_preset('brace', estimator_settings={'horizon': 5})\n"
            "assert copc.ADVANTAGE_ESTIMATORS.metadata('vtrace')['per_token_obs_discount'] is False\n"
            "print(cfg.estimator_settings.horizon, 'torch' in sys.modules)\n"
            "copc.compute_advantages\n"
            "print('torch' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         check=True)
    assert out.stdout.split() == ["5", "False", "True"]
