"""The learner step written once (:class:`trainer.learner.template.TemplateLearner`) and the one
optimiser-settings object every backend gets (:class:`trainer.learner.settings.OptimizerSettings`).

Real components: a tiny Qwen2 saved with ``save_pretrained``, the torch backend, the fsdp backend
on one gloo rank.
"""

from __future__ import annotations

import pytest
import torch

import copc
from trainer.config import load_config
from trainer.config.specs import learner_config, learner_spec, optimizer_settings
from trainer.learner import LearnerConfig, OptimizerSettings, TorchLearner, make_learner
from trainer.learner.optim import TorchOptimizer, make_torch_optimizer
from trainer.models.loading import load_model_and_tokenizer
from trainer.models.tiny import TinyModelConfig, save_tiny_checkpoint
from trainer.rollout.batch import RolloutBatch, to_batch
from trainer.rollout.trajectory import Trajectory

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    return str(save_tiny_checkpoint(tmp_path_factory.mktemp("tiny_template"),
                                    TinyModelConfig(hidden_size=32, intermediate_size=64, num_layers=2)))


def multiturn_batch(n: int = 6) -> RolloutBatch:
    """``n`` two-turn episodes of different lengths, µ off-policy, rewards 0/1, groups of 2."""
    g = torch.Generator().manual_seed(0)
    trs = []
    for i in range(n):
        tr = Trajectory(prompt_ids=[40 + i, 41], sample_id=i, group_id=i // 2)
        ids = torch.randint(0, 255, (5 + i,), generator=g).tolist()
        tr.append_model_tokens(ids[:3], [-5.0] * 3, 0)
        tr.append_observation_tokens(ids[3:4])
        tr.append_model_tokens(ids[4:], [-5.5] * len(ids[4:]), 0)
        tr.reward = float(i % 2)
        trs.append(tr)
    return to_batch(trs, 0)


class RecordingLearner(TorchLearner):
    """The torch backend, recording every hook call the template step makes."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.calls: list[str] = []

    def place(self, batch):
        self.calls.append("place")
        return super().place(batch)

    def recompute(self, batch):
        self.calls.append("recompute")
        return super().recompute(batch)

    def update(self, role, mini, x, den, acc):
        self.calls.append(f"update {role} {len(mini)} rows")
        super().update(role, mini, x, den, acc)

    def backward(self, role, mini, x, den):
        self.calls.append(f"backward {role}")
        return super().backward(role, mini, x, den)

    def schedule(self, actor_updated):
        self.calls.append(f"schedule actor_updated={actor_updated}")
        return super().schedule(actor_updated)


def test_the_template_step_calls_the_backend_hooks_in_order(tiny):
    """Step 0 is a critic warm-up step (no actor update, the actor's schedule does not move), step 1
    updates both; two mini-batches of 3 rows each; the learning rates follow the 2-step warm-up."""
    actor, _ = load_model_and_tokenizer(tiny)
    cfg = LearnerConfig(optim=OptimizerSettings(actor_lr=1e-2, critic_lr=4e-3, warmup_steps=2),
                        num_mini_batches=2, micro_batch_size=2, critic_warmup_steps=1)
    lrn = RecordingLearner(actor, copc.get_preset("copc"), cfg)
    before = {k: v.clone() for k, v in actor.state_dict().items()}
    batch = multiturn_batch(6)

    m0 = lrn.step(batch)
    critic_update = ["update critic 3 rows", "backward critic"]
    assert lrn.calls == ["place", "recompute", *critic_update, *critic_update, "schedule actor_updated=False"]
    assert m0["actor/updated"] == 0.0 and "actor/grad_norm" not in m0 and m0["critic/grad_norm"] > 0
    assert m0["actor/lr"] == pytest.approx(1e-2 * 1 / 2)  # warm-up factor (0 + 1) / 2, not advanced
    assert lrn.critic_opt.lr == pytest.approx(4e-3)  # advanced once: factor (1 + 1) / 2
    assert all(torch.equal(v, before[k]) for k, v in actor.state_dict().items())  # the actor is frozen

    lrn.calls.clear()
    m1 = lrn.step(batch)
    both = ["update actor 3 rows", "backward actor", *critic_update]
    assert lrn.calls == ["place", "recompute", *both, *both, "schedule actor_updated=True"]
    assert m1["actor/updated"] == 1.0 and m1["actor/grad_norm"] > 0
    assert m1["actor/lr"] == pytest.approx(1e-2)
    assert lrn.policy_version == 2
    assert max(float((v - before[k]).abs().max()) for k, v in actor.state_dict().items()) > 1e-4


def test_fsdp_on_one_rank_gives_the_torch_backend_s_parameters_after_one_step(tiny):
    """Same init (the same checkpoint), same batch, AdamW with warm-up and active clipping, one
    thread each: the fsdp backend on one gloo rank runs the same template step as the torch
    backend and ends with identical weights and identical metrics (bit for bit)."""
    ov = ["preset=copc", "train.actor_lr=1e-2", "train.critic_lr=1e-2", "train.micro_batch_size=2",
          "train.num_mini_batches=2", "train.grad_clip=0.5", "train.warmup_steps=2", "train.torch_threads=1",
          "learner.optimizer=adamw", "rollout.n_samples_per_prompt=2"]
    batch = multiturn_batch(6)
    ref = make_learner(learner_spec(load_config(None, ov)), tiny)
    init = {k: v.clone() for k, v in ref.actor.state_dict().items()}
    m_ref = ref.step(batch)
    fsdp = load_config(None, [*ov, "learner.backend=fsdp", "learner.backend_settings.world_size=1"])
    with make_learner(learner_spec(fsdp), tiny) as lrn:
        m = lrn.step(batch)
        weights = dict(lrn.export_policy_weights())
    ref_w = ref.actor.state_dict()
    assert set(weights) == set(ref_w)
    assert all(torch.equal(weights[k], ref_w[k]) for k in ref_w)
    assert max(float((init[k] - ref_w[k]).abs().max()) for k in ref_w) > 1e-4  # the step moved them
    assert m_ref["actor/grad_norm"] > 0.5  # clipping was active
    assert {k: v for k, v in m.items() if not k.startswith("perf/")} == \
        {k: v for k, v in m_ref.items() if not k.startswith("perf/")}


def test_optimizer_settings_are_read_once_from_the_config():
    exp = load_config(None, ["train.actor_lr=3e-4", "train.critic_lr=2e-3", "train.weight_decay=0.1",
                             "train.grad_clip=0.7", "train.warmup_steps=4", "learner.optimizer=sgd"])
    want = OptimizerSettings(name="sgd", actor_lr=3e-4, critic_lr=2e-3, weight_decay=0.1, grad_clip=0.7,
                             warmup_steps=4)
    assert optimizer_settings(exp) == want
    assert learner_config(exp).optim == want
    assert [want.warmup_factor(i) for i in range(5)] == [0.25, 0.5, 0.75, 1.0, 1.0]
    assert OptimizerSettings().warmup_factor(0) == 1.0
    assert (want.lr("actor"), want.lr("critic")) == (3e-4, 2e-3)


def test_the_torch_optimizer_uses_every_setting():
    s = OptimizerSettings(actor_lr=1e-2, critic_lr=2e-2, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.1)
    adamw = make_torch_optimizer(s, [torch.nn.Parameter(torch.zeros(2))], "critic")
    group = adamw.param_groups[0]
    assert isinstance(adamw, torch.optim.AdamW)
    got = (group["lr"], group["betas"], group["eps"], group["weight_decay"])
    assert got == (2e-2, (0.8, 0.95), 1e-6, 0.1)
    sgd = make_torch_optimizer(OptimizerSettings(name="sgd", actor_lr=0.5),
                               [torch.nn.Parameter(torch.zeros(1))], "actor")
    assert isinstance(sgd, torch.optim.SGD)
    assert (sgd.param_groups[0]["momentum"], sgd.param_groups[0]["lr"]) == (0, 0.5)

    # SGD at lr 0.5 (the first of a 2-step warm-up), clip at norm 1: the gradient (3, 4) has norm 5
    p = torch.nn.Parameter(torch.zeros(2))
    opt = TorchOptimizer([p], OptimizerSettings(name="sgd", actor_lr=1.0, grad_clip=1.0, warmup_steps=2),
                         "actor")
    assert opt.lr == 0.5
    p.grad = torch.tensor([3.0, 4.0])
    assert opt.step() == pytest.approx(5.0)
    assert p.detach().tolist() == pytest.approx([-0.3, -0.4], abs=1e-6)  # -0.5 · (0.6, 0.8)
    opt.schedule_step()
    assert opt.lr == 1.0
    opt.zero_grad()
    assert p.grad is None
    no_clip = TorchOptimizer([p], OptimizerSettings(grad_clip=0.0), "actor")
    p.grad = torch.ones(2)
    assert no_clip.step() is None


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"name": "adam"}, "learner.optimizer='adam'"),
    ({"actor_lr": -1.0}, "actor_lr=-1.0"),
    ({"grad_clip": float("nan")}, "grad_clip=nan"),
    ({"betas": (0.9, 1.0)}, r"betas=\(0.9, 1.0\)"),
    ({"eps": 0.0}, "eps=0.0"),
])
def test_bad_optimizer_settings_name_the_field(kwargs, match):
    with pytest.raises(ValueError, match=match):
        OptimizerSettings(**kwargs)
