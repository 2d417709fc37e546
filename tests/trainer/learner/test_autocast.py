"""``learner.backend_settings.autocast_dtype: bfloat16`` on a real (tiny) transformers model: the forward
passes run in bfloat16 (log-probs and values move by bfloat16 rounding, not more), the update direction is the
float32 one, weights / gradients / optimizer state stay float32, the attestation's reference stays exactly
float32, and off is bit-identical to a learner without the setting."""

from __future__ import annotations

import pytest
import torch

import copc
from trainer.config import ConfigError, load_config, plugin_settings
from trainer.learner.backends.torch import TorchLearner
from trainer.learner.settings import LearnerConfig, OptimizerSettings
from trainer.models.loading import load_model_and_tokenizer
from trainer.models.tiny import TinyModelConfig, save_tiny_checkpoint
from trainer.orchestration.attestation import PROBE_PROMPTS

from ..orchestration.test_loop_learner import _batch  # six two-turn episodes, rewards 0/1

OPT = OptimizerSettings(actor_lr=1e-3, critic_lr=1e-3, grad_clip=0.0)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return str(save_tiny_checkpoint(tmp_path_factory.mktemp("tiny_autocast"),
                                    TinyModelConfig(hidden_size=64, intermediate_size=128, num_layers=2)))


def _learner(tiny, autocast, optim=OPT, **settings):
    """A torch learner on ``tiny`` (``settings``: more LearnerConfig fields) with a random value head."""
    actor, tok = load_model_and_tokenizer(tiny)
    cfg = LearnerConfig(optim=optim, autocast_dtype=autocast, **settings)
    learner = TorchLearner(actor, copc.get_preset("copc"), cfg)
    g = torch.Generator().manual_seed(0)  # a value head that reads the hidden states (it starts at 0)
    head = learner.critic.value_head.weight
    with torch.no_grad():
        head.copy_(torch.randn(head.shape, generator=g))
    return learner, tok


def _grads(model):
    return torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])


def test_bfloat16_forward_passes_stay_within_rounding_of_float32(tiny):
    (f32, tok), (bf16, _) = _learner(tiny, None), _learner(tiny, "bfloat16")
    batch = _batch(tok)
    m = batch.loss_mask.bool()
    lp32, v32 = f32.recompute(batch)
    lp16, v16 = bf16.recompute(batch)
    assert lp16.dtype == v16.dtype == torch.float32
    diff = (lp16 - lp32)[m].abs()
    assert 0 < diff.max() < 0.1, diff.max()  # bf16 ran (not bit-equal), and only rounding apart
    assert diff.mean() < 0.03
    dv = (v16 - v32)[m].abs().max()
    assert 0 < dv <= 0.02 * v32[m].abs().max(), (dv, v32[m].abs().max())  # values: relative rounding
    assert (lp16[~m] == 0).all()  # masked positions still 0

    # one forward + backward of a token-sum of log-probs: the same direction, float32 gradients
    for learner in (f32, bf16):
        learner.actor.zero_grad()
        learner.logprobs(batch)[m].sum().backward()
    g32, g16 = _grads(f32.actor), _grads(bf16.actor)
    assert g16.dtype == torch.float32 and all(p.dtype == torch.float32 for p in bf16.actor.parameters())
    cos = torch.nn.functional.cosine_similarity(g32, g16, dim=0)
    assert cos > 0.99 and 0.9 < g16.norm() / g32.norm() < 1.1, (cos, g16.norm() / g32.norm())


def test_a_bfloat16_step_trains_and_keeps_float32_state(tiny):
    learner, tok = _learner(tiny, "bfloat16", OptimizerSettings(actor_lr=1e-3, critic_lr=1e-3))
    metrics = learner.step(_batch(tok), version=0)
    assert all(torch.isfinite(torch.tensor(v)) for v in metrics.values() if isinstance(v, float))
    assert metrics["actor/grad_norm"] > 0 and metrics["critic/grad_norm"] > 0
    state = learner.actor_opt.optimizer.state_dict()["state"]
    assert state and all(t.dtype == torch.float32 for s in state.values()
                         for k, t in s.items() if k != "step")


def test_the_attestation_reference_is_float32_whatever_the_autocast(tiny):
    (f32, _), (bf16, _) = _learner(tiny, None), _learner(tiny, "bfloat16")
    ids = torch.tensor(PROBE_PROMPTS)
    assert torch.equal(f32.next_token_logprobs(ids, 1.0), bf16.next_token_logprobs(ids, 1.0))


def test_off_is_bit_identical_to_the_default(tiny):
    (a, tok), (b, _) = _learner(tiny, None), _learner(tiny, None)
    b.cfg = LearnerConfig(optim=OPT)  # a config that never mentions the setting
    batch = _batch(tok)
    a.step(batch, version=0)
    b.step(batch, version=0)
    for (n, p), (_, q) in zip(a.actor.named_parameters(), b.actor.named_parameters(), strict=True):
        assert torch.equal(p, q), n


def test_bad_settings_are_one_line_naming_the_key():
    with pytest.raises(ConfigError, match=r"learner\.backend_settings\.autocast_dtype.*float16.*must be null "
                                          r"\(float32\) or 'bfloat16'"):
        load_config("configs/math_tool/cpu_tiny.yaml", ["learner.backend_settings.autocast_dtype=float16"])
    # a backend whose settings have no autocast_dtype refuses it, naming the key
    with pytest.raises(ConfigError, match=r"learner\.backend_settings\.autocast_dtype='bfloat16': unknown "
                                          r"setting of DistributedSettings"):
        load_config("configs/math_tool/cpu_tiny.yaml",
                    ["learner.backend_settings.autocast_dtype=bfloat16", "learner.backend=fsdp"])
    cfg = load_config("configs/math_tool/cpu_tiny.yaml", ["learner.backend_settings.autocast_dtype=bfloat16"])
    assert plugin_settings(cfg, "learner.backend").autocast_dtype == "bfloat16"
    with pytest.raises(ValueError, match=r"learner\.backend_settings\.autocast_dtype='fp8'"):
        LearnerConfig(autocast_dtype="fp8")
