"""The megatron backend on a CUDA GPU (marker ``gpu``: skipped where no GPU is visible; run by
``scripts/gpu_check.sh``): one rank with NCCL, Megatron's distributed optimizer, activation
recompute — the GPU path the CPU suite cannot reach — against the torch backend on the CPU.

The step has two PPO mini-batches, so the actor and the critic are updated twice: Megatron's SGD
default momentum (0.9) would change the second update, and its default exemption of biases and
1-D parameters from weight decay would change every update (``train.weight_decay=0.1``); both
must match plain ``torch.optim.SGD`` over all parameters. Building the model at all needs the
CUDA RNG tracker seeded (Megatron's GPU weight init forks into it).
"""

from __future__ import annotations

import pytest

from trainer.config import load_config
from trainer.config.specs import learner_spec
from trainer.learner import make_learner
from trainer.models.tiny import TinyModelConfig, save_tiny_checkpoint

from .test_megatron_learner import assert_same_metrics, max_diff, multiturn_batch, overrides

pytestmark = pytest.mark.gpu


def test_megatron_on_gpu_steps_like_the_torch_backend(tmp_path):
    tiny = str(save_tiny_checkpoint(tmp_path / "tiny", TinyModelConfig(hidden_size=32, intermediate_size=64,
                                                                      num_layers=2)))
    batch = multiturn_batch()
    common = overrides("copc", "sgd", **{"train.weight_decay": "0.1"})
    ref = make_learner(learner_spec(load_config(None, common)), tiny)  # the torch backend, on the CPU
    m_ref = ref.step(batch)
    cfg = load_config(None, [*common, "learner.backend_settings.gradient_checkpointing=true",
                             "learner.backend=megatron", "learner.backend_settings.world_size=1",
                             "learner.backend_settings.dist_backend=nccl",
                             "learner.backend_settings.timeout_s=300"])
    with make_learner(learner_spec(cfg), tiny) as lrn:
        m = lrn.step(batch)
        weights = dict(lrn.export_policy_weights())
    assert m_ref["actor/updated"] == 1.0 and m_ref["actor/grad_norm"] > 0.5
    assert_same_metrics(m_ref, m, tol=1e-4)
    assert max_diff(weights, ref.actor.state_dict()) < 1e-4
