"""The seams of issue 10: Learner protocol + backend registry, engine registry, true logged losses,
weight export; each extension is one registration and works end to end through ``copc train``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import copc
from trainer.config import ConfigError, load_config
from trainer.config.specs import learner_spec
from trainer.engines import ENGINES, EngineHandle, register_engine
from trainer.engines.builtin import embedded_engine
from trainer.learner import (
    LEARNERS,
    Learner,
    LearnerConfig,
    OptimizerSettings,
    TorchLearner,
    make_learner,
    register_learner,
)
from trainer.learner.backends.torch import response_logprobs
from trainer.learner.step_metrics import MetricAccumulator
from trainer.models.export import save_hf_weights
from trainer.models.loading import load_model_and_tokenizer
from trainer.models.tiny import TinyModelConfig, save_tiny_checkpoint
from trainer.rollout.batch import to_batch
from trainer.rollout.trajectory import Trajectory

from .test_run_e2e import overrides

DATA = Path(__file__).parent.resolve().parents[2] / "data"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return str(save_tiny_checkpoint(tmp_path_factory.mktemp("tiny_seams"),
                                    TinyModelConfig(hidden_size=32, intermediate_size=64, num_layers=1)))


def _two_rows(tok):
    """2 sequences of different lengths, off-policy, with an observation in the middle."""
    trs = []
    for i, (n1, n2) in enumerate([(3, 2), (5, 4)]):
        tr = Trajectory(prompt_ids=tok.encode(f"q{i}", add_special_tokens=False), sample_id=i, group_id=i)
        tr.append_model_tokens(list(range(65, 65 + n1)), [-4.0] * n1, 0)
        tr.append_observation_tokens([10, 11])
        tr.append_model_tokens(list(range(70, 70 + n2)), [-4.5] * n2, 0)
        tr.reward = float(i)
        trs.append(tr)
    return to_batch(trs, tok.pad_token_id)


def test_logged_pg_loss_is_the_true_minibatch_loss(tiny):
    """Review finding: with micro-batch 1 the logged loss was the true loss / number of micro-batches."""
    _, tok = load_model_and_tokenizer(tiny)
    batch = _two_rows(tok)
    logged = {}
    for mbs in (1, 2):
        torch.manual_seed(0)
        actor, _ = load_model_and_tokenizer(tiny)
        learner = TorchLearner(actor, copc.get_preset("copc_wo_rc"), LearnerConfig(
            optim=OptimizerSettings(grad_clip=0.0), micro_batch_size=mbs))
        # the true loss of the whole mini-batch, computed directly from copc with the step's inputs
        with torch.no_grad():
            logp = response_logprobs(actor, batch, 1.0)
            vals = learner.critic.response_values(batch.input_ids, batch.attention_mask, batch.position_ids,
                                                  batch.prompt_len)
        x, _ = learner.algorithm.advantages(batch, logp, vals, 0)
        den = learner.algorithm.denominators(batch)
        true_loss, true_met = learner.algorithm.policy_loss(logp, batch, x, den)
        logged[mbs] = learner.step(batch)
        assert logged[mbs]["actor/pg_loss"] == pytest.approx(float(true_loss), abs=1e-6)
        for k in ("actor/dis_masked_frac", "actor/ratio_mean"):  # token-weighted over micro-batches
            assert logged[mbs][k] == pytest.approx(true_met[k], abs=1e-6)
        assert logged[mbs]["actor/ratio_max"] == pytest.approx(true_met["actor/ratio_max"], abs=1e-6)
    assert logged[1]["actor/pg_loss"] == pytest.approx(logged[2]["actor/pg_loss"], abs=1e-6)
    assert logged[1]["critic/value_loss"] == pytest.approx(logged[2]["critic/value_loss"], abs=1e-6)


def test_metric_accumulator_rules():
    acc = MetricAccumulator()
    acc.add_micro({"actor/pg_loss": -1.0, "actor/clipfrac": 0.5, "actor/ratio_max": 2.0}, tokens=2)
    acc.add_micro({"actor/pg_loss": -2.5, "actor/clipfrac": 0.0, "actor/ratio_max": 3.0}, tokens=6)
    acc.add("actor/grad_norm", 4.0)
    acc.end_mini_batch()
    acc.add_micro({"actor/pg_loss": 0.5, "actor/clipfrac": 1.0, "actor/ratio_max": 1.0}, tokens=2)
    acc.add("actor/grad_norm", 2.0)
    out = acc.result()
    assert out["actor/pg_loss"] == pytest.approx((-3.5 + 0.5) / 2)   # summed per mini-batch, averaged
    assert out["actor/clipfrac"] == pytest.approx((0.5 * 2 + 0 * 6 + 1.0 * 2) / 10)  # token-weighted
    assert out["actor/ratio_max"] == 3.0 and out["actor/grad_norm"] == 3.0


def test_torch_learner_is_a_learner_and_exports_hf_weights(tiny, tmp_path):
    cfg = load_config(None, [f"model.path={tiny}"])
    learner = make_learner(learner_spec(cfg), tiny)
    assert isinstance(learner, Learner) and isinstance(learner, TorchLearner) and learner.policy_version == 0
    out = save_hf_weights(learner.export_policy_weights(), tiny, tmp_path / "export")
    reloaded, _ = load_model_and_tokenizer(out)
    for k, v in reloaded.state_dict().items():
        assert torch.equal(v, learner.actor.state_dict()[k]), k
    assert (out / "tokenizer.json").is_file()
    with pytest.raises(ConfigError, match=r"learner.backend='nope': not a registered learner backend; "
                                          r"known: \[") as err:
        load_config(None, ["learner.backend=nope"])
    # the list may hold backends a plugin test registered earlier in the session (sorted among them)
    known = str(err.value).split("known: ")[1].split("]")[0]
    assert {"'fsdp'", "'megatron'", "'torch'"} <= {k.strip() for k in known.strip("[").split(",")}


class CountingLearner(TorchLearner):
    """A user's backend: the torch one, counting its steps (stands in for e.g. a Megatron one)."""

    steps_seen = 0

    def step(self, batch, version=None):
        CountingLearner.steps_seen += 1
        return {**super().step(batch, version), "custom/steps_seen": float(CountingLearner.steps_seen)}


def test_a_registered_learner_backend_trains_through_copc_train(tmp_path):
    from trainer.app.run import run_experiment

    def factory(spec, model_dir):
        base = TorchLearner.from_spec(spec, model_dir)
        return CountingLearner(base.actor, base.algo, base.cfg)

    register_learner("counting", factory)
    try:
        cfg = load_config(None, overrides(tmp_path / "r", "copc", steps=2, **{"learner.backend": "counting"}))
        summary = run_experiment(cfg)
    finally:
        LEARNERS.unregister("counting")
    assert summary["steps"] == 2 and CountingLearner.steps_seen == 2
    rows = [json.loads(line) for line in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()]
    assert [r["custom/steps_seen"] for r in rows if "custom/steps_seen" in r] == [1.0, 2.0]


def test_a_registered_engine_is_used_by_copc_train(tmp_path):
    """An engine is one factory + one registration; rollouts and evaluation go through it."""
    from trainer.app.run import run_experiment

    calls = {"make": 0, "generate": 0, "sync": []}

    def counting_engine(spec):
        inner = embedded_engine(spec)
        calls["make"] += 1
        real = inner.engine.generate

        async def generate(prompt_ids, params):
            calls["generate"] += 1
            return await real(prompt_ids, params)

        inner.engine.generate = generate

        async def sync(weights, version):
            calls["sync"].append(version)
            await inner.sync(weights, version)

        return EngineHandle(inner.engine, sync, inner.close)

    def preflight(check):  # an EngineCheck: the engine's settings, the rollouts' sampling, LoRA, fixed lag
        if check.sampling.temperature > 5:
            raise ConfigError("rollout.temperature: too hot for the counting engine")

    register_engine("counting", counting_engine, preflight=preflight)
    try:
        with pytest.raises(ConfigError, match="too hot"):
            run_experiment(load_config(None, overrides(tmp_path / "hot", "copc", **{
                "rollout.engine": "counting", "rollout.temperature": "9.0"})))
        cfg = load_config(None, overrides(tmp_path / "r", "copc", steps=2, **{"rollout.engine": "counting"}))
        summary = run_experiment(cfg)
    finally:
        ENGINES.unregister("counting")
    assert summary["steps"] == 2 and calls["make"] == 1
    assert calls["generate"] >= 4 and calls["sync"] == [1, 2]  # weights pushed after each step
    with pytest.raises(ConfigError, match=r"rollout.engine='counting': not a registered engine"):
        load_config(None, ["rollout.engine=counting"])


PLUGIN = '''
import copc
import torch


@copc.ADVANTAGE_ESTIMATORS.register("plugin_mc", needs_critic=False)
def plugin_mc(inputs, cfg):
    """Undiscounted reward-to-go over action tokens (a user's estimator)."""
    r = torch.where(inputs.loss_mask.bool(), inputs.rewards, torch.zeros_like(inputs.rewards))
    ret = r.flip(-1).cumsum(-1).flip(-1) * inputs.loss_mask
    return ret, ret
'''


def test_plugins_register_before_validation_and_train(tmp_path, monkeypatch):
    """``plugins: [file.py]``: imported before the config is validated (the CLI has no other hook)."""
    from trainer.app.run import run_experiment

    (tmp_path / "my_algos.py").write_text(PLUGIN)
    monkeypatch.setenv("COPC_DATA_DIR", str(DATA))
    monkeypatch.chdir(tmp_path)
    algo = "algorithm={advantage_estimator: plugin_mc, use_critic: false}"
    with pytest.raises(ConfigError, match=r"algorithm.advantage_estimator.*plugin_mc"):
        load_config(None, [*overrides(tmp_path / "no", "copc"), algo])
    with pytest.raises(ConfigError, match=r"plugins\[0\]='missing.py': cannot import it: FileNotFoundError"):
        load_config(None, ["plugins=[missing.py]"])
    try:
        cfg = load_config(None, [*overrides(tmp_path / "r", "copc", steps=2), algo, "plugins=[my_algos.py]"])
        summary = run_experiment(cfg)
        assert cfg.algorithm_config().use_critic is False
    finally:
        copc.ADVANTAGE_ESTIMATORS.unregister("plugin_mc")
    assert summary["steps"] == 2
    rows = [json.loads(line) for line in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "actor/total_loss" in r] == [1, 2]
    assert not any("critic/value_loss" in r for r in rows)


def test_missing_data_and_bad_eval_checkpoint_are_config_errors(tmp_path, monkeypatch):
    import environments.data
    from trainer.app.run import run_evaluation, run_experiment

    data = str(DATA)
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("COPC_DATA_DIR", raising=False)
    monkeypatch.setattr(environments.data, "FALLBACK_DATA_DIR", str(tmp_path / "no-data"))  # installed copy
    with pytest.raises(ConfigError, match=r"task.data_dir='': .*math_train.*does not exist, as in an "
                                          r"installed copy: set \$COPC_DATA_DIR.*set task.data_dir or "
                                          r"\$COPC_DATA_DIR"):
        run_experiment(load_config(None, overrides(tmp_path / "m", "copc")))
    (tmp_path / "junk").mkdir()
    cfg = load_config(None, overrides(tmp_path / "e", "copc", **{"task.data_dir": data}))
    with pytest.raises(ConfigError, match=r"--checkpoint='.*junk': neither a model directory"):
        run_evaluation(cfg, checkpoint=str(tmp_path / "junk"))
