"""The VAPO options wired into the learner (docs/vapo.md): decoupled / length-adaptive λ, Monte-Carlo
critic targets during the critic warm-up, the positive-example LM term of the actor loss, and the
configs/recipes/vapo.yaml fragment."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

import copc
from copc.advantages import length_adaptive_lambda
from trainer.config import ConfigError, load_config
from trainer.learner import LearnerConfig, OptimizerSettings, TorchLearner
from trainer.learner.algorithm import ActorCriticAlgorithm, MiniBatchDenominators
from trainer.models.loading import load_model_and_tokenizer
from trainer.models.tiny import TinyModelConfig, save_tiny_checkpoint
from trainer.rollout.batch import to_batch
from trainer.rollout.trajectory import Trajectory

sys.path.insert(0, str(Path(__file__).parent.resolve().parents[1] / "copc"))
from reference import coupled_reference, random_multiturn_mask

ROOT = Path(__file__).parent.resolve().parents[2]
CRITIC_PRESETS = ("ppo", "ppo_async", "areal", "vtrace", "copc_wo_rc", "copc")
VAPO = dict(critic_lam=1.0, length_adaptive_alpha=0.05, pos_lm_coef=0.1, critic_warmup_mc_returns=True,
            policy_loss_settings={"clip_low": 0.2, "clip_high": 0.28}, loss_agg_mode="token-mean")


def _inputs(B: int = 8, T: int = 40, seed: int = 0) -> copc.AdvantageInputs:
    g = torch.Generator().manual_seed(seed)
    mask = random_multiturn_mask(B, T, g)
    rewards = torch.zeros(B, T)
    for b in range(B):
        rewards[b, mask[b].nonzero()[-1]] = float(b % 2)
    logp_old = -torch.rand(B, T, generator=g)
    return copc.AdvantageInputs(rewards=rewards, loss_mask=mask, values=torch.randn(B, T, generator=g),
                                logp_old=logp_old, logp_mu=logp_old + 0.3 * torch.randn(B, T, generator=g),
                                scores=rewards.sum(1), group_ids=torch.arange(B))


def _batch(rewards=(0.0, 1.0, 1.0)):
    """Multi-turn trajectories of different lengths (an observation in the middle), off-policy µ."""
    trs = []
    for i, r in enumerate(rewards):
        n1, n2 = 3 + i, 2 + 2 * i
        tr = Trajectory(prompt_ids=[40 + i, 41], sample_id=i, group_id=i)
        tr.append_model_tokens(list(range(65, 65 + n1)), [-4.0] * n1, 0)
        tr.append_observation_tokens([10, 11])
        tr.append_model_tokens(list(range(70, 70 + n2)), [-4.5] * n2, 0)
        tr.reward = r
        trs.append(tr)
    return to_batch(trs, 0)


# -- advantages ---------------------------------------------------------------------------------

@pytest.mark.parametrize("preset", ["copc", "ppo_async"])
def test_decoupled_gae_against_the_reference_loop(preset):
    """critic_lam: returns are the λ = 1 returns, advantages the λ_actor ones (slow per-token loop)."""
    x = _inputs()
    algo = copc.get_preset(preset, gamma=0.99, lam=0.8, critic_lam=1.0)
    adv, ret, _ = ActorCriticAlgorithm(algo).estimate(x)
    eta_a = algo.estimator_settings.eta_a if preset == "copc" else None
    lo, hi = copc.margins(eta_a, algo.eps_low, algo.eps_high) if preset == "copc" else (1.0, 1.0)
    args = (x.rewards.double(), x.values.double(), x.logp_old.double(), x.logp_mu.double(), x.loss_mask)
    ref_adv, _ = coupled_reference(*args, 0.99, 0.8, lo, hi)
    _, ref_ret = coupled_reference(*args, 0.99, 1.0, lo, hi)
    torch.testing.assert_close(adv.double(), ref_adv, rtol=0, atol=2e-5)
    torch.testing.assert_close(ret.double(), ref_ret, rtol=0, atol=2e-5)
    assert (adv.double() - coupled_reference(*args, 0.99, 1.0, lo, hi)[0]).abs().max() > 1e-2  # λ matters


@pytest.mark.parametrize("preset", CRITIC_PRESETS)
def test_length_adaptive_actor_advantages_are_the_estimator_row_by_row(preset):
    x = _inputs(seed=1)
    algo = copc.get_preset(preset, gamma=0.99, length_adaptive_alpha=0.2)
    adv, ret, met = ActorCriticAlgorithm(algo).estimate(x)
    lam = length_adaptive_lambda(x.loss_mask, 0.2)
    for b in range(x.loss_mask.shape[0]):
        row = copc.AdvantageInputs(**{k: None if v is None else v[b:b + 1] for k, v in vars(x).items()})
        a_b, _ = copc.compute_advantages(row, algo.replace(lam=float(lam[b])))
        torch.testing.assert_close(adv[b:b + 1], a_b, rtol=0, atol=1e-6)
    assert torch.equal(ret, copc.compute_advantages(x, algo)[1])  # critic λ = lam: the usual returns
    has = x.loss_mask.any(1)
    assert met["advantage/actor_lam_mean"] == pytest.approx(float(lam[has].mean()))


def test_length_adaptive_then_whitening_over_the_whole_batch():
    x = _inputs(seed=2)
    algo = copc.get_preset("copc", length_adaptive_alpha=0.2)
    raw, _, _ = ActorCriticAlgorithm(algo).estimate(x)
    white, _, _ = ActorCriticAlgorithm(algo.replace(normalize_advantages=True)).estimate(x)
    assert torch.equal(white, copc.masked_whiten(raw, x.loss_mask))
    assert float(white[x.loss_mask].mean()) == pytest.approx(0.0, abs=1e-6)


@pytest.mark.parametrize("preset", [*CRITIC_PRESETS, "dapo"])
def test_options_off_is_the_spec_path_bit_for_bit(preset):
    x = _inputs(seed=3)
    for algo in (copc.get_preset(preset), copc.get_preset(preset, lam=0.9, gamma=0.95)):
        if algo.use_critic:
            algo = algo.replace(critic_lam=algo.lam)  # the same λ for both: still one call
        adv, ret, met = ActorCriticAlgorithm(algo).estimate(x, critic_warmup=True)  # no MC option
        ref_adv, ref_ret = copc.compute_advantages(x, algo)
        assert torch.equal(adv, ref_adv) and torch.equal(ret, ref_ret) and met == {}


@pytest.mark.parametrize("gamma", [1.0, 0.5])
def test_monte_carlo_critic_targets_during_the_critic_warmup(gamma):
    """Warm-up steps: returns = γ-discounted reward-to-go (hand-computed), whatever V and ρ̄;
    after the warm-up: the estimator's returns again."""
    batch = _batch()
    B, T = batch.loss_mask.shape
    g = torch.Generator().manual_seed(4)
    values, logp_old = torch.randn(B, T, generator=g), batch.logp_mu + 0.2 * torch.randn(B, T, generator=g)
    alg = ActorCriticAlgorithm(copc.get_preset("copc", gamma=gamma, critic_warmup_mc_returns=True),
                               critic_warmup_steps=2)
    x, met = alg.advantages(batch, logp_old, values, 0, steps_done=1)
    assert met["critic/mc_targets"] == 1.0
    m = batch.loss_mask.bool()
    for b in range(B):
        acts = m[b].nonzero().squeeze(1).tolist()
        expected = [float(batch.scores[b]) * gamma ** (len(acts) - 1 - k) for k in range(len(acts))]
        assert x.returns[b, acts].tolist() == pytest.approx(expected, abs=1e-6)
    usual = copc.compute_advantages(copc.AdvantageInputs(
        rewards=batch.rewards, loss_mask=batch.loss_mask, values=values, logp_old=logp_old,
        logp_mu=batch.logp_mu, scores=batch.scores, group_ids=batch.group_ids), alg.algo)
    assert torch.equal(x.advantages, usual[0])
    for steps_done in (2, None):  # after the warm-up, or no step count: the estimator's returns
        x2, met2 = alg.advantages(batch, logp_old, values, 2, steps_done=steps_done)
        assert torch.equal(x2.returns, usual[1]) and "critic/mc_targets" not in met2
    assert (usual[1][m] - x.returns[m]).abs().max() > 1e-2


# -- positive-example LM term -------------------------------------------------------------------

def test_policy_loss_adds_the_positive_lm_term_hand_computed():
    batch = _batch(rewards=(1.0, 0.0, 0.75))  # rows 0 and 2 are positive (> 0.5)
    m = batch.loss_mask.bool()
    logp = (batch.logp_mu + 0.01 * torch.arange(m.numel()).view(m.shape)).requires_grad_()
    algo = copc.get_preset("ppo_async", pos_lm_coef=0.1, loss_agg_mode="token-mean")
    alg = ActorCriticAlgorithm(algo)
    x, _ = alg.advantages(batch, batch.logp_mu, torch.zeros(m.shape), 0)
    den = alg.denominators(batch)
    assert isinstance(den, MiniBatchDenominators)
    assert den.positive == copc.Denominators(int(m[[0, 2]].sum()), 2)
    loss, met = alg.policy_loss(logp, batch, x, den)
    base, _ = copc.compute_policy_loss(logp, copc.PolicyLossInputs(
        logp_old=x.logp_old, logp_mu=batch.logp_mu, advantages=x.advantages, loss_mask=batch.loss_mask,
        denominators=den), algo)
    pos_tok = m & torch.tensor([True, False, True]).unsqueeze(1)
    nll = -float(logp.detach()[pos_tok].sum()) / int(pos_tok.sum())
    assert met["actor/pos_lm_loss"] == pytest.approx(nll, rel=1e-6)
    assert float((loss - base).detach()) == pytest.approx(0.1 * nll, rel=1e-5)
    assert met["actor/pos_lm_token_frac"] == pytest.approx(int(pos_tok.sum()) / int(m.sum()))
    # the extra gradient is −μ/N on the positive episodes' action tokens and exactly 0 elsewhere
    extra = torch.autograd.grad(loss, logp, retain_graph=True)[0] - torch.autograd.grad(base, logp)[0]
    torch.testing.assert_close(extra, torch.where(pos_tok, -0.1 / int(pos_tok.sum()), 0.0), rtol=0, atol=1e-7)
    assert torch.equal(extra[~pos_tok], torch.zeros(int((~pos_tok).sum())))
    # micro-batches with the mini-batch denominators sum to the mini-batch loss
    parts = sum(float(alg.policy_loss(logp.detach()[i:i + 1], batch.select(slice(i, i + 1)),
                                      x.rows_slice(slice(i, i + 1)), den)[0]) for i in range(3))
    assert parts == pytest.approx(float(loss.detach()), abs=1e-6)


def test_policy_loss_without_the_option_is_unchanged():
    batch = _batch()
    alg = ActorCriticAlgorithm(copc.get_preset("copc"))
    x, _ = alg.advantages(batch, batch.logp_mu, torch.zeros(batch.loss_mask.shape), 0)
    den = alg.denominators(batch)
    assert den.positive is None
    loss, met = alg.policy_loss(batch.logp_mu, batch, x, den)
    ref, ref_met = copc.compute_policy_loss(batch.logp_mu, copc.PolicyLossInputs(
        logp_old=x.logp_old, logp_mu=batch.logp_mu, advantages=x.advantages, loss_mask=batch.loss_mask,
        denominators=copc.batch_denominators(batch.loss_mask)), alg.algo)
    # the learner adds its count of tokens outside π's sampling support (none: no top-k / top-p here)
    assert met.pop("actor/outside_support_frac") == 0.0
    assert torch.equal(loss, ref) and met == ref_met


# -- the learner and the config fragment --------------------------------------------------------

@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return str(save_tiny_checkpoint(tmp_path_factory.mktemp("tiny_vapo"),
                                    TinyModelConfig(hidden_size=32, intermediate_size=64, num_layers=1)))


def test_torch_learner_runs_the_whole_recipe(tiny):
    """Step 0: critic-only on Monte-Carlo targets (actor untouched); step 1: actor with the length-
    adaptive advantages and the positive-example LM term; the logged losses do not depend on the
    micro-batch size (global denominators, positive ones included)."""
    logged = []
    for mbs in (1, 3):
        torch.manual_seed(0)
        actor, _ = load_model_and_tokenizer(tiny)
        before = {k: v.clone() for k, v in actor.state_dict().items()}
        learner = TorchLearner(actor, copc.get_preset("ppo_async", **VAPO), LearnerConfig(
            optim=OptimizerSettings(actor_lr=1e-3, critic_lr=1e-3, grad_clip=0.0),
            critic_warmup_steps=1, micro_batch_size=mbs))
        m0 = learner.step(_batch())
        assert m0["actor/updated"] == 0.0 and m0["critic/mc_targets"] == 1.0
        assert "actor/pos_lm_loss" not in m0
        assert all(torch.equal(before[k], v) for k, v in actor.state_dict().items())
        m1 = learner.step(_batch())
        assert m1["actor/updated"] == 1.0 and "critic/mc_targets" not in m1
        assert m1["actor/pos_lm_loss"] > 0.0 and m1["actor/pos_lm_token_frac"] > 0.5
        assert 0.0 <= m1["advantage/actor_lam_mean"] < 1.0
        assert all(torch.isfinite(torch.tensor(v)) for v in m1.values())
        logged.append(m1)
    for k in ("actor/pos_lm_loss", "actor/pg_loss", "critic/value_loss"):
        assert logged[0][k] == pytest.approx(logged[1][k], abs=1e-5), k


@pytest.mark.parametrize("task", ["math_tool", "search"])
def test_vapo_fragment_composes_with_every_critic_preset(task, tmp_path):
    fragment = ROOT / "configs/recipes/vapo.yaml"
    clip_higher = ROOT / "configs/recipes/vapo_clip_higher.yaml"  # part (4): PPO-clip losses' settings
    for preset in CRITIC_PRESETS:
        user = tmp_path / f"{preset}.yaml"
        ppo_clip = preset not in ("copc_wo_rc", "copc")
        user.write_text(f"defaults: [{ROOT / 'configs' / task / preset}.yaml, {fragment}"
                        f"{f', {clip_higher}' if ppo_clip else ''}]\n"
                        f"name: {task}_{preset}_vapo\n")
        cfg = load_config(user, [f"model.path={tmp_path}"])
        algo = cfg.algorithm_config()
        assert algo.name == preset and cfg.name == f"{task}_{preset}_vapo"
        assert (algo.critic_lam, algo.length_adaptive_alpha, algo.pos_lm_coef) == (1.0, 0.05, 0.1)
        assert algo.loss_agg_mode == "token-mean"
        if ppo_clip:
            clip = algo.policy_loss_settings
            assert (clip.clip_low, clip.clip_high) == (0.2, 0.28)
        else:  # the DIS loss has no PPO clip: the clip-higher fragment is refused, naming the key
            base = ROOT / "configs" / task / f"{preset}.yaml"
            user.write_text(f"defaults: [{base}, {fragment}, {clip_higher}]\n")
            with pytest.raises(ConfigError, match=r"algorithm\.policy_loss_settings\.clip_high=0\.28: "
                                                  r"unknown setting of DisSettings"):
                load_config(user, [f"model.path={tmp_path}"]).algorithm_config()
        assert algo.critic_warmup_mc_returns and cfg.train.critic_warmup_steps == 50
        assert (cfg.train.prompts_per_step, cfg.rollout.n_samples_per_prompt) == (32, 8)
        assert (algo.gamma, algo.lam, algo.eps_low, algo.eps_high) == (1.0, 1.0, 0.4, 0.56)  # paper's
    for preset in ("dapo", "sao"):  # critic-free presets refuse it, naming the key
        user = tmp_path / f"{preset}.yaml"
        user.write_text(f"defaults: [{ROOT / 'configs' / task / preset}.yaml, {fragment}]\n")
        with pytest.raises(ConfigError, match=r"^algorithm\.critic_lam: .*needs a critic"):
            load_config(user, [f"model.path={tmp_path}"])
