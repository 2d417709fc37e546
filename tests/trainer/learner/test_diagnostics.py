"""Per-step off-policy diagnostics: masked/clipped fractions, Kish ESS/N, |log ρ| by staleness,
critic value bias and its EMA drift (copc.metrics + ActorCriticAlgorithm + TorchLearner + plots).

The fixed batch (B = 2, T = 5; ``a`` action token, ``o`` observation, ``-`` padding), learner
version 5, both channels' interval (ℓ, u) = (0.8, 1.28) (paper defaults):

    row 0:  a    a    o    a    -        row 1:  o    a    a    o    a
    ρ       0.5  1.0  .    1.5  .        ρ       .    1.2  2.0  .    0.9
    version 3    3    .    4    .        version .    2    2    .    4      → staleness 2,2,1 / 3,3,1
    reward  0    0.5  .    1.0  .        reward  .    0    -.25 .    1.0
    V       2.0 (first action token)     V       0.2 (first action token, t = 1)

Hand-computed values (N = 6 action tokens):
* policy channel M = 1{0.8 < ρ < 1.28}: masked low {0.5} = 1/6, high {1.5, 2.0} = 2/6;
  w = ρM = (0, 1, 0, 1.2, 0, 0.9): Σw = 3.1, Σw² = 3.25, ESS/N = 3.1² / (6 · 3.25) = 9.61 / 19.5.
* advantage channel ρ̄ = clip(ρ, 0.8, 1.28) = (0.8, 1, 1.28, 1.2, 1.28, 0.9): clipped low 1/6,
  high 2/6; Σρ̄ = 6.46, Σρ̄² = 7.1668, ESS/N = 6.46² / (6 · 7.1668).
* mean |log ρ|: s1 = (ln 1.5 + |ln 0.9|)/2, s2 = (ln 2 + 0)/2, s3 = (ln 1.2 + ln 2)/2.
* value bias, γ = 1: R = (1.5, 0.75), V − R = (0.5, −0.55): bias −0.025, |bias| 0.525;
  γ = 0.5 (discount per action-token index): R = (0.5·0.5 + 1·0.25, −0.25·0.5 + 1·0.25) =
  (0.5, 0.125), V − R = (1.5, 0.075): bias 0.7875, |bias| 0.7875.
"""

from __future__ import annotations

import math

import matplotlib.image as mpimg
import pytest
import torch

import copc
from copc.metrics import (
    abs_log_ratio_by_staleness,
    advantage_channel_ess,
    ema_drift,
    kish_ess_fraction,
    policy_channel_diagnostics,
    value_bias_metrics,
)
from trainer.learner.algorithm import ActorCriticAlgorithm
from trainer.learner.backends.torch import TorchLearner, mb_values, response_logprobs
from trainer.learner.settings import LearnerConfig, OptimizerSettings
from trainer.learner.step_metrics import ValueBiasTracker
from trainer.models.loading import load_model_and_tokenizer
from trainer.models.tiny import TinyModelConfig, save_tiny_checkpoint
from trainer.outputs.metrics_log import MetricsLogger
from trainer.outputs.plots import diagnostics_figure, make_plots
from trainer.rollout.batch import RolloutBatch, to_batch
from trainer.rollout.trajectory import Trajectory

pytestmark = pytest.mark.usefixtures("one_torch_thread")
Tensor = torch.Tensor

VERSION = 5
MASK = torch.tensor([[1, 1, 0, 1, 0], [0, 1, 1, 0, 1]], dtype=torch.float32)
RHO = torch.tensor([[0.5, 1.0, 1.0, 1.5, 1.0], [1.0, 1.2, 2.0, 1.0, 0.9]], dtype=torch.float64)
VERSIONS = torch.tensor([[3, 3, -1, 4, -1], [-1, 2, 2, -1, 4]])
REWARDS = torch.tensor([[0.0, 0.5, 0.0, 1.0, 0.0], [0.0, 0.0, -0.25, 0.0, 1.0]])
VALUES = torch.tensor([[2.0, 9.0, 9.0, 9.0, 9.0], [7.0, 0.2, 9.0, 9.0, 9.0]])
LOGP_MU = torch.full((2, 5), -1.0)
LOGP_OLD = (LOGP_MU.double() + RHO.log()).float()

POLICY_ESS = 3.1 ** 2 / (6 * 3.25)
ADVANTAGE_ESS = 6.46 ** 2 / (6 * 7.1668)
ABS_LOG = {1: (math.log(1.5) + abs(math.log(0.9))) / 2, 2: math.log(2.0) / 2,
           3: (math.log(1.2) + math.log(2.0)) / 2}
BIAS_G1, BIAS_ABS_G1 = -0.025, 0.525


def _trajectories() -> list[Trajectory]:
    """The fixed batch's two episodes (token ids arbitrary; behavior log-probs −1)."""
    t0 = Trajectory(prompt_ids=[40, 41], sample_id=0, group_id=0)
    t0.append_model_tokens([65, 66], [-1.0, -1.0], 3)
    t0.add_reward(0.5)
    t0.append_observation_tokens([10])
    t0.append_model_tokens([67], [-1.0], 4)
    t0.add_reward(1.0)
    t1 = Trajectory(prompt_ids=[42], sample_id=1, group_id=1)
    t1.append_observation_tokens([11])
    t1.append_model_tokens([68, 69], [-1.0, -1.0], 2)
    t1.add_reward(-0.25)
    t1.append_observation_tokens([12])
    t1.append_model_tokens([70], [-1.0], 4)
    t1.add_reward(1.0)
    return [t0, t1]


def _batch() -> RolloutBatch:
    b = to_batch(_trajectories(), pad_token_id=0)
    assert torch.equal(b.loss_mask, MASK) and torch.equal(b.versions, VERSIONS)
    assert torch.equal(b.rewards, REWARDS)
    return b


def _with_garbage(b: RolloutBatch, logp_old: Tensor, values: Tensor):
    """Copies with NaN / ±inf / huge values at every mask-0 position."""
    off = b.loss_mask == 0
    g = RolloutBatch(**{**b.__dict__})
    g.logp_mu = torch.where(off, float("-inf"), b.logp_mu)
    g.rewards = torch.where(off, 1e9, b.rewards)
    g.versions = torch.where(off, 999, b.versions)  # "newer than the learner": must be ignored there
    return g, torch.where(off, float("nan"), logp_old), torch.where(off, float("inf"), values)



# ---------------------------------------------------------------------------- pure functions
def test_kish_ess_fraction_hand_values_and_zero_cases():
    m = torch.tensor([[1, 1, 0], [1, 0, 0]])
    w = torch.tensor([[1.0, 2.0, float("nan")], [3.0, 5.0, 7.0]])
    assert kish_ess_fraction(w, m) == pytest.approx(36 / (3 * 14))
    assert kish_ess_fraction(torch.ones(2, 3), m) == 1.0
    assert kish_ess_fraction(w, torch.zeros(2, 3)) is None  # N = 0: metric omitted
    assert kish_ess_fraction(torch.zeros(2, 3), m) == 0.0  # every weight 0: no effective sample
    with pytest.raises(ValueError, match="loss_mask has shape"):
        kish_ess_fraction(w, torch.ones(3, 2))


def test_policy_channel_fractions_and_ess():
    d = policy_channel_diagnostics(LOGP_OLD, LOGP_MU, MASK, 0.8, 1.28)
    assert d["diag/policy_masked_low_frac"] == pytest.approx(1 / 6)
    assert d["diag/policy_masked_high_frac"] == pytest.approx(2 / 6)
    assert d["diag/policy_masked_frac"] == pytest.approx(3 / 6)
    assert d["diag/policy_ess_frac"] == pytest.approx(POLICY_ESS, abs=1e-6)
    none = policy_channel_diagnostics(LOGP_OLD, LOGP_MU, torch.zeros(2, 5), 0.8, 1.28)
    assert "diag/policy_ess_frac" not in none and none["diag/policy_masked_frac"] == 0.0
    # logp_mu = -inf at an action token: ρ = inf, masked high, weight 0 (no NaN)
    mu = LOGP_MU.clone()
    mu[0, 1] = float("-inf")
    d = policy_channel_diagnostics(LOGP_OLD, mu, MASK, 0.8, 1.28)
    assert d["diag/policy_masked_high_frac"] == pytest.approx(3 / 6)
    assert d["diag/policy_ess_frac"] == pytest.approx(2.1 ** 2 / (6 * 2.25), abs=1e-6)


def test_advantage_channel_ess_and_clip_fractions():
    assert advantage_channel_ess(LOGP_OLD, LOGP_MU, MASK, 0.8, 1.28)["diag/advantage_ess_frac"] == \
        pytest.approx(ADVANTAGE_ESS, abs=1e-6)
    c = copc.advantage_channel_metrics(LOGP_OLD, LOGP_MU, MASK, 0.8, 1.28)
    assert c["advantage/clipped_low_frac"] == pytest.approx(1 / 6)
    assert c["advantage/clipped_high_frac"] == pytest.approx(2 / 6)
    # η_A = 0: ρ̄ ≡ 1, ESS/N = 1 exactly
    assert advantage_channel_ess(LOGP_OLD, LOGP_MU, MASK, 1.0, 1.0)["diag/advantage_ess_frac"] == 1.0
    assert advantage_channel_ess(LOGP_OLD, LOGP_MU, torch.zeros(2, 5), 0.8, 1.28) == {}


def test_abs_log_ratio_by_staleness():
    d = abs_log_ratio_by_staleness(LOGP_OLD, LOGP_MU, VERSIONS, VERSION, MASK)
    assert sorted(d) == [f"diag/abs_log_ratio_s{k}" for k in (1, 2, 3)]
    for k, v in ABS_LOG.items():
        assert d[f"diag/abs_log_ratio_s{k}"] == pytest.approx(v, abs=1e-6)
    # a non-finite |log ρ| is left out of its level's mean; a level with only those is NaN
    mu = LOGP_MU.clone()
    mu[0, 3] = float("-inf")  # the ρ = 1.5 token of level 1
    d = abs_log_ratio_by_staleness(LOGP_OLD, mu, VERSIONS, VERSION, MASK)
    assert d["diag/abs_log_ratio_s1"] == pytest.approx(abs(math.log(0.9)), abs=1e-6)
    one = torch.tensor([[1, 0, 0, 0, 0], [0, 0, 0, 0, 0]])
    assert math.isnan(abs_log_ratio_by_staleness(LOGP_OLD, mu.fill_(float("-inf")), VERSIONS, VERSION,
                                                 one)["diag/abs_log_ratio_s2"])
    with pytest.raises(ValueError, match="newer than current_version 3"):
        abs_log_ratio_by_staleness(LOGP_OLD, LOGP_MU, VERSIONS, 3, MASK)
    with pytest.raises(ValueError, match="token_versions must be an integer tensor"):
        abs_log_ratio_by_staleness(LOGP_OLD, LOGP_MU, VERSIONS.float(), VERSION, MASK)


def test_value_bias_hand_values():
    d = value_bias_metrics(VALUES, REWARDS, MASK, 1.0)
    assert d["critic/value_bias"] == pytest.approx(BIAS_G1)
    assert d["critic/value_bias_abs"] == pytest.approx(BIAS_ABS_G1)
    d = value_bias_metrics(VALUES, REWARDS, MASK, 0.5)
    assert (d["critic/value_bias"], d["critic/value_bias_abs"]) == pytest.approx((0.7875, 0.7875))
    # a row without action tokens is not an episode of the probe
    three = torch.cat([MASK, torch.zeros(1, 5)])
    d3 = value_bias_metrics(torch.cat([VALUES, torch.full((1, 5), 50.0)]),
                            torch.cat([REWARDS, torch.ones(1, 5)]), three, 1.0)
    assert d3["critic/value_bias"] == pytest.approx(BIAS_G1)
    assert value_bias_metrics(VALUES, REWARDS, torch.zeros(2, 5), 1.0) == {}
    with pytest.raises(ValueError, match="gamma must be in"):
        value_bias_metrics(VALUES, REWARDS, MASK, 1.5)


def _slow_value_bias(values, rewards, mask, gamma):
    """Reference: explicit loops over rows and action tokens."""
    errs = []
    for b in range(mask.shape[0]):
        acts = [t for t in range(mask.shape[1]) if mask[b, t] == 1]
        if acts:
            ret = sum(gamma ** j * float(rewards[b, t]) for j, t in enumerate(acts))
            errs.append(float(values[b, acts[0]]) - ret)
    return sum(errs) / len(errs), sum(abs(e) for e in errs) / len(errs)


def test_value_bias_matches_slow_loop_on_random_batches():
    g = torch.Generator().manual_seed(0)
    for _ in range(5):
        mask = (torch.rand(6, 9, generator=g) < 0.6).float()
        mask[0] = 0  # one empty row
        v, r = torch.randn(6, 9, generator=g), torch.randn(6, 9, generator=g)
        for gamma in (1.0, 0.9, 0.0):
            d = value_bias_metrics(v, r, mask, gamma)
            assert (d["critic/value_bias"], d["critic/value_bias_abs"]) == \
                pytest.approx(_slow_value_bias(v, r, mask, gamma), abs=1e-5)


def test_ema_drift_and_tracker_across_steps_and_state_round_trip():
    assert ema_drift(2.0, None) == (0.0, 2.0)
    drift, ema = ema_drift(3.0, 2.0)
    assert (drift, ema) == pytest.approx((1.0, 2.1))
    drift, ema = ema_drift(1.0, ema)
    assert (drift, ema) == pytest.approx((-1.1, 1.99))
    d, e = ema_drift(float("nan"), 1.99)
    assert math.isnan(d) and e == 1.99
    with pytest.raises(ValueError, match="decay must be in"):
        ema_drift(1.0, None, 1.0)

    a = ValueBiasTracker()
    assert a.update({}) == {} and a.ema is None  # no critic / no episode: EMA untouched
    assert a.update({"critic/value_bias": 2.0}) == {"critic/value_bias_drift": 0.0}
    assert a.update({"critic/value_bias": 3.0})["critic/value_bias_drift"] == pytest.approx(1.0)
    b = ValueBiasTracker()
    b.load_state_dict(a.state_dict())
    assert b.ema == pytest.approx(2.1)
    assert b.update({"critic/value_bias": 1.0})["critic/value_bias_drift"] == pytest.approx(-1.1)
    with pytest.raises(ValueError, match="value_bias_ema"):
        b.load_state_dict({"value_bias_ema": "x"})
    with pytest.raises(ValueError, match="value_bias_ema"):
        b.load_state_dict({})


# ---------------------------------------------------------------------------- the algorithm
@pytest.mark.parametrize("preset", copc.PRESET_NAMES)
def test_off_policy_diagnostics_per_preset(preset):
    algo = copc.get_preset(preset)
    alg = ActorCriticAlgorithm(algo)
    b = _batch()
    d = alg.off_policy_diagnostics(b, LOGP_OLD, VALUES if algo.use_critic else None, VERSION)
    has_pol, has_adv = algo.policy_loss == "dis", algo.advantage_estimator == "copc"
    assert ("diag/policy_ess_frac" in d) == has_pol and ("diag/policy_masked_low_frac" in d) == has_pol
    assert ("diag/advantage_ess_frac" in d) == has_adv and ("advantage/clipped_low_frac" in d) == has_adv
    assert ("critic/value_bias_drift" in d) == algo.use_critic
    assert "advantage/ratio_mean" in d and d["staleness/max"] == 3.0
    for k, v in ABS_LOG.items():
        assert d[f"diag/abs_log_ratio_s{k}"] == pytest.approx(v, abs=1e-6)
    if has_pol:  # η_P = 0.5 in every dis preset: (0.8, 1.28)
        assert d["diag/policy_masked_high_frac"] == pytest.approx(2 / 6)
        assert d["diag/policy_ess_frac"] == pytest.approx(POLICY_ESS, abs=1e-6)
    if preset == "copc":
        assert d["diag/advantage_ess_frac"] == pytest.approx(ADVANTAGE_ESS, abs=1e-6)
    if preset == "copc_wo_rc":  # η_A = 0: ρ̄ ≡ 1, every ρ ≠ 1 counts as clipped
        assert d["diag/advantage_ess_frac"] == 1.0
        assert (d["advantage/clipped_low_frac"], d["advantage/clipped_high_frac"]) == \
            pytest.approx((2 / 6, 3 / 6))
    if algo.use_critic:
        assert (d["critic/value_bias"], d["critic/value_bias_drift"]) == pytest.approx((BIAS_G1, 0.0))
    # the π-referenced probes (copc.value_probes), whole batch and per staleness level
    assert ("value/policy_value_gap" in d) == algo.use_critic == ("value/b_hat_s3" in d)


def test_garbage_at_mask0_positions_changes_nothing():
    b = _batch()
    g, lp, v = _with_garbage(b, LOGP_OLD, VALUES)
    clean = ActorCriticAlgorithm(copc.get_preset("copc")).off_policy_diagnostics(b, LOGP_OLD, VALUES, VERSION)
    dirty = ActorCriticAlgorithm(copc.get_preset("copc")).off_policy_diagnostics(g, lp, v, VERSION)
    assert clean.keys() == dirty.keys()
    for k in clean:
        assert clean[k] == pytest.approx(dirty[k], abs=1e-12), k
    for name in ("policy_channel_diagnostics", "advantage_channel_ess"):  # the pure functions too
        fn = {"policy_channel_diagnostics": policy_channel_diagnostics,
              "advantage_channel_ess": advantage_channel_ess}[name]
        assert fn(LOGP_OLD, LOGP_MU, MASK, 0.8, 1.28) == fn(lp, g.logp_mu, MASK, 0.8, 1.28), name
    assert value_bias_metrics(VALUES, REWARDS, MASK, 0.5) == value_bias_metrics(v, g.rewards, MASK, 0.5)


# ---------------------------------------------------------------------------- a real learner step
@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return str(save_tiny_checkpoint(tmp_path_factory.mktemp("tiny_diag"),
                                    TinyModelConfig(hidden_size=32, intermediate_size=64, num_layers=1)))


def _learner(tiny) -> TorchLearner:
    torch.manual_seed(0)
    actor, _ = load_model_and_tokenizer(tiny)
    learner = TorchLearner(actor, copc.get_preset("copc"), LearnerConfig(
        optim=OptimizerSettings(actor_lr=1e-3, critic_lr=1e-2)))
    learner.steps_done = VERSION  # the learner is at policy version 5
    return learner


def _batch_for(learner: TorchLearner) -> RolloutBatch:
    """The fixed batch with µ set so that ρ = π_old/µ is exactly the table's ρ at action tokens."""
    b = _batch()
    learner.actor.eval()
    with torch.no_grad():
        logp = response_logprobs(learner.actor, b, 1.0)
    b.logp_mu = torch.where(b.loss_mask.bool(), (logp.double() - RHO.log()).float(), 0.0)
    return b


def test_learner_step_logs_every_diagnostic_with_hand_values(tiny):
    learner = _learner(tiny)
    b = _batch_for(learner)
    m = learner.step(b)
    assert m["diag/policy_masked_low_frac"] == pytest.approx(1 / 6)
    assert m["diag/policy_masked_high_frac"] == pytest.approx(2 / 6)
    assert m["diag/policy_ess_frac"] == pytest.approx(POLICY_ESS, abs=1e-4)
    assert m["advantage/clipped_low_frac"] == pytest.approx(1 / 6)
    assert m["advantage/clipped_high_frac"] == pytest.approx(2 / 6)
    assert m["diag/advantage_ess_frac"] == pytest.approx(ADVANTAGE_ESS, abs=1e-4)
    for k, v in ABS_LOG.items():
        assert m[f"diag/abs_log_ratio_s{k}"] == pytest.approx(v, abs=1e-4)
    assert not any(k.startswith("diag/abs_log_ratio_s") and k[-1] not in "123" for k in m)
    # the critic's value head starts at zero: V_first = 0, bias = −mean(R) = −(1.5 + 0.75)/2
    assert m["critic/value_bias"] == pytest.approx(-1.125, abs=1e-6)
    assert m["critic/value_bias_abs"] == pytest.approx(1.125, abs=1e-6)
    assert m["critic/value_bias_drift"] == 0.0
    assert learner.algorithm.value_bias.ema == pytest.approx(-1.125, abs=1e-6)

    # second step: drift = new bias − EMA(first); the EMA survives a state_dict round trip
    with torch.no_grad():
        learner.critic.eval()
        v2 = mb_values(learner.critic, b)
    bias2 = float(((v2[0, 0] - 1.5) + (v2[1, 1] - 0.75)) / 2)
    assert abs(bias2 + 1.125) > 1e-3, "the critic update must have moved V"
    resumed = _learner(tiny)
    resumed.load_state_dict(learner.state_dict())
    assert resumed.algorithm.value_bias.ema == learner.algorithm.value_bias.ema
    m2 = learner.step(b)
    assert m2["critic/value_bias"] == pytest.approx(bias2, abs=1e-5)
    assert m2["critic/value_bias_drift"] == pytest.approx(bias2 + 1.125, abs=1e-5)
    assert learner.algorithm.value_bias.ema == pytest.approx(0.9 * -1.125 + 0.1 * bias2, abs=1e-5)
    r2 = resumed.step(b)
    assert r2["critic/value_bias_drift"] == pytest.approx(m2["critic/value_bias_drift"], abs=1e-5)
    # the pooled probes' window survives the round trip too: both pool the 2 steps' 4 episodes
    assert m2["value/pooled_episodes"] == r2["value/pooled_episodes"] == 4.0
    assert r2["value/pooled_policy_value_gap"] == pytest.approx(m2["value/pooled_policy_value_gap"], abs=1e-5)


def test_old_checkpoint_without_diagnostics_loads(tiny):
    learner = _learner(tiny)
    learner.algorithm.value_bias.ema = 3.0
    state = learner.state_dict()
    assert state["diagnostics"]["value_bias_ema"] == 3.0 and state["diagnostics"]["value_probe_window"] == []
    del state["diagnostics"]
    fresh = _learner(tiny)
    fresh.algorithm.value_bias.ema = 7.0
    fresh.load_state_dict(state)
    assert fresh.algorithm.value_bias.ema is None  # restarts: drift 0 at the next step


def test_critic_free_learner_has_no_value_bias(tiny):
    actor, _ = load_model_and_tokenizer(tiny)
    learner = TorchLearner(actor, copc.get_preset("sao"), LearnerConfig())
    learner.steps_done = VERSION
    assert learner.critic is None
    m = learner.step(_batch_for(learner))
    assert not any(k.startswith("critic/value_bias") for k in m)
    assert "diag/advantage_ess_frac" not in m and "advantage/clipped_frac" not in m  # no advantage channel
    assert m["diag/policy_ess_frac"] == pytest.approx(POLICY_ESS, abs=1e-4)  # sao: DIS, η_P = 0.5
    assert {f"diag/abs_log_ratio_s{k}" for k in (1, 2, 3)} <= m.keys()
    assert learner.state_dict()["diagnostics"] == {"value_bias_ema": None, "value_probe_window": []}


# ---------------------------------------------------------------------------- logging and plots
def _history(n: int = 12) -> list[dict]:
    recs = []
    for s in range(1, n + 1):
        recs.append({"step": s, "diag/policy_masked_low_frac": 0.01 * s, "diag/policy_masked_high_frac": 0.02,
                     "advantage/clipped_low_frac": 0.03, "advantage/clipped_high_frac": 0.005 * s,
                     "diag/policy_ess_frac": 1 - 0.01 * s, "diag/advantage_ess_frac": 0.99,
                     **{f"diag/abs_log_ratio_s{k}": 0.05 * (k + 1) + 0.001 * s for k in range(s % 4 + 1)},
                     "critic/value_bias": 0.5 - 0.05 * s, "critic/value_bias_abs": 0.6,
                     "critic/value_bias_drift": -0.05 if s > 1 else 0.0})
    return recs


def _png_height(path) -> int:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    return int.from_bytes(data[20:24], "big")


def test_diagnostics_png_has_one_panel_per_group(tmp_path):
    paths = make_plots(_history(), tmp_path / "all")
    diag = tmp_path / "all" / "diagnostics.png"
    assert diag in paths and paths[-1] == diag
    assert _png_height(diag) == 4 * 320  # 4 panels, 3.2 in each at 100 dpi
    assert mpimg.imread(diag)[..., :3].std() > 0.02  # not a blank canvas
    # only the critic-free groups (no value bias): 3 panels; the fallback to actor/dis_masked_*
    no_critic = [{k: v for k, v in r.items() if not k.startswith(("critic/", "diag/policy_masked"))}
                 | {"actor/dis_masked_low_frac": 0.1} for r in _history()]
    make_plots(no_critic, tmp_path / "nc")
    assert _png_height(tmp_path / "nc" / "diagnostics.png") == 3 * 320
    # with the π-referenced value probes: a fifth panel
    probes = {"value/policy_value_gap": 0.1, "value/b_hat": -0.05}
    make_plots([{**r, **probes} for r in _history()], tmp_path / "pi")
    assert _png_height(tmp_path / "pi" / "diagnostics.png") == 5 * 320
    # the pooled probes (issue 46 item 3) are drawn in that panel beside the per-step ones
    pooled = {**probes, "value/pooled_policy_value_gap": 0.02, "value/pooled_b_hat": -0.01}
    panel = diagnostics_figure([{**r, **pooled} for r in _history()]).axes[-1]
    # the panel's curves, less the unlabelled 0 line
    labels = [ln.get_label() for ln in panel.get_lines() if not ln.get_label().startswith("_")]
    assert sorted(labels) == sorted(pooled)
    assert "diagnostics.png" not in [p.name for p in make_plots([{"step": 1, "x": 1.0}], tmp_path / "none")]


def test_small_masked_fractions_fill_their_panel():
    """Regression: the masked/clipped panel had y from -0.02 up to the data, so the usual fractions
    of ~0.001 were squashed into the top few pixels. Now it spans 0 (less 2 %) to the max + 5 %."""
    recs = [{"step": s, "diag/policy_masked_low_frac": 0.001 * s, "diag/policy_masked_high_frac": 0.0,
             "advantage/clipped_low_frac": 0.0005, "advantage/clipped_high_frac": 0.0,
             "diag/policy_ess_frac": 0.99, "diag/advantage_ess_frac": 1.0} for s in range(1, 5)]
    fig = diagnostics_figure(recs)
    frac, ess = fig.axes
    assert frac.get_ylim() == pytest.approx((-0.02 * 0.004 * 1.05, 0.004 * 1.05))
    assert ess.get_ylim() == pytest.approx((-0.02, 1.05))
    # all-zero fractions: a 0.001-wide panel, not a degenerate one
    zeros = [{**r, "diag/policy_masked_low_frac": 0.0, "advantage/clipped_low_frac": 0.0} for r in recs]
    assert diagnostics_figure(zeros).axes[0].get_ylim() == pytest.approx((-0.02 * 1.05e-3, 1.05e-3))
    assert diagnostics_figure([{"step": 1, "x": 1.0}]) is None


def test_diagnostics_reach_jsonl_and_tensorboard(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    with MetricsLogger(tmp_path, tensorboard=True) as ml:
        for r in _history(3):
            ml.log(r["step"], {k: v for k, v in r.items() if k != "step"})
        recs = ml.read()
    assert recs[2]["diag/abs_log_ratio_s3"] == pytest.approx(0.2 + 0.003)
    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert {"diag/policy_ess_frac", "diag/advantage_ess_frac", "critic/value_bias_drift",
            "diag/abs_log_ratio_s0", "diag/abs_log_ratio_s3", "advantage/clipped_high_frac"} <= tags
    assert [e.value for e in acc.Scalars("critic/value_bias")] == pytest.approx([0.45, 0.4, 0.35])
