"""SAO's critic options on a real (tiny) transformers model: K critic updates per actor update
(``train.critic_updates_per_step``) and a critic whose attention is frozen
(``learner.backend_settings.critic_freeze_attention``), and the sao_critic / brace presets through
the learner."""

from __future__ import annotations

import copy

import pytest
import torch

import copc
from trainer.config import ConfigError, load_config
from trainer.config.specs import learner_config
from trainer.learner.algorithm import ActorCriticAlgorithm
from trainer.learner.backends.torch import TorchLearner
from trainer.learner.critic import freeze_attention
from trainer.learner.settings import LearnerConfig, OptimizerSettings
from trainer.learner.step_metrics import MetricAccumulator
from trainer.models.loading import load_model_and_tokenizer
from trainer.models.tiny import TinyModelConfig, save_tiny_checkpoint

from ..orchestration.test_loop_learner import _batch  # six two-turn episodes, rewards 0/1

OPT = OptimizerSettings(actor_lr=1e-2, critic_lr=1e-2)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return str(save_tiny_checkpoint(tmp_path_factory.mktemp("tiny_critic"),
                                    TinyModelConfig(hidden_size=32, intermediate_size=64, num_layers=2)))


def _learner(tiny, preset="copc", **cfg):
    actor, tok = load_model_and_tokenizer(tiny)
    return TorchLearner(actor, copc.get_preset(preset), LearnerConfig(optim=OPT, **cfg)), tok


def _params(model):
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def test_the_loop_runs_k_critic_updates_after_each_actor_update():
    calls = []
    algo = ActorCriticAlgorithm(copc.get_preset("copc"), num_mini_batches=2, critic_updates_per_step=3)

    class Rows:  # the loop only selects rows and asks for their denominators
        def __len__(self):
            return 4

        def select(self, idx):
            return tuple(idx)

    class X:
        def rows(self, idx):
            return None

    algo.denominators = lambda mini: None
    algo.mini_batch_updates(Rows(), X(), 5, has_critic=True,
                            update=lambda role, mini, x, den, acc: calls.append((role, mini)))
    minis = [tuple(m) for m in algo.mini_batches(4, 5)]
    assert calls == [(r, m) for m in minis for r in ("actor", "critic", "critic", "critic")]
    with pytest.raises(ValueError, match="critic_updates_per_step=0"):
        ActorCriticAlgorithm(copc.get_preset("copc"), critic_updates_per_step=0)


def test_k2_is_one_more_critic_update_on_the_same_targets_and_the_actor_is_unchanged(tiny):
    one, tok = _learner(tiny)
    two, _ = _learner(tiny, critic_updates_per_step=2)
    batch = _batch(tok)
    m1, m2 = one.step(batch), two.step(batch)
    # the actor's one update came first, from the same advantages: bit-identical
    a1, a2 = _params(one.actor), _params(two.actor)
    assert all(torch.equal(a1[n], a2[n]) for n in a1)
    # the second critic update of K = 2 is K = 1's critic updated once more on the same mini-batch
    c1, c2 = _params(one.critic), _params(two.critic)
    assert max((c1[n] - c2[n]).abs().max().item() for n in c1) > 1e-4
    mini = batch.select(one.algorithm.mini_batches(len(batch), 0)[0])
    x = one.last_step_inputs.rows(one.algorithm.mini_batches(len(batch), 0)[0])
    acc = MetricAccumulator()
    one.update("critic", mini, x, one.algorithm.denominators(mini), acc)
    acc.end_mini_batch()
    c1 = _params(one.critic)
    for n in c1:
        torch.testing.assert_close(c1[n], c2[n], atol=1e-6, rtol=1e-5)
    # the reported value loss is the mean over both updates
    extra = acc.result()["critic/value_loss"]
    assert extra != pytest.approx(m1["critic/value_loss"], abs=1e-4)
    assert m2["critic/value_loss"] == pytest.approx((m1["critic/value_loss"] + extra) / 2, rel=1e-5)


def test_frozen_critic_attention_stays_as_loaded_and_the_rest_trains(tiny):
    learner, tok = _learner(tiny, critic_freeze_attention=True)
    c0, a0 = _params(learner.critic), _params(learner.actor)
    learner.step(_batch(tok))  # the value head starts at 0: the backbone gets gradient from step 2
    learner.step(_batch(tok))
    c1, a1 = _params(learner.critic), _params(learner.actor)
    attn = [n for n in c0 if ".self_attn." in n]
    assert len(attn) >= 2 * 4  # 2 layers × q, k, v, o (+ biases)
    assert all(not p.requires_grad for n, p in learner.critic.named_parameters() if n in attn)
    assert all(torch.equal(c0[n], c1[n]) for n in attn)
    others = [n for n in c0 if n not in attn and "mlp" in n]
    assert others and all(not torch.equal(c0[n], c1[n]) for n in others)
    # the actor shares nothing with it: its attention trained
    assert any(not torch.equal(a0[n], a1[n]) for n in a0 if ".self_attn." in n)


def test_freeze_attention_refuses_a_model_without_attention():
    with pytest.raises(ValueError, match=r"learner\.backend_settings\.critic_freeze_attention: the critic "
                                         r"has no trainable attention module"):
        freeze_attention(torch.nn.Sequential(torch.nn.Linear(2, 2)))


@pytest.mark.parametrize("preset", ["sao_critic", "brace"])
def test_critic_presets_train_through_the_learner(tiny, preset):
    learner, tok = _learner(tiny, preset)
    c0 = copy.deepcopy(_params(learner.critic))
    m = learner.step(_batch(tok))
    assert m["actor/updated"] == 1.0 and m["critic/value_loss"] > 0
    assert any(not torch.equal(c0[n], p) for n, p in _params(learner.critic).items())


def test_config_keys_are_validated_in_one_line():
    cfg = load_config("configs/search/sao_critic.yaml", ["model.path=."])
    assert cfg.train.critic_updates_per_step == 2 and cfg.algorithm_config().advantage_estimator == "gae"
    assert learner_config(cfg).critic_updates_per_step == 2
    with pytest.raises(ConfigError, match=r"train\.critic_updates_per_step.*must be an int >= 1"):
        load_config("configs/math_tool/cpu_tiny.yaml", ["train.critic_updates_per_step=0"])
    with pytest.raises(ConfigError, match=r"learner\.backend_settings\.critic_freeze_attention=True: unknown "
                                          r"setting of DistributedSettings"):  # fsdp has no such setting
        load_config("configs/math_tool/cpu_tiny.yaml",
                    ["learner.backend=fsdp",
                     "learner.backend_settings={critic_freeze_attention: true, world_size: 2}"])
    cfg = load_config("configs/math_tool/cpu_tiny.yaml",
                      ["learner.backend_settings.critic_freeze_attention=true"])
    assert learner_config(cfg).critic_freeze_attention
