"""Megatron models from Hugging Face checkpoints (mbridge), on 2 gloo ranks on CPU.

* HF → Megatron (TP = 2, also TP = 1) → HF export is bit-exact for tiny Qwen2 and Llama (tied
  embeddings) and Qwen3 (q/k norms, untied LM head); the critic exports as the torch backend's
  ``ValueModel`` from the same checkpoint, bit for bit.
* vocab-parallel per-token log-probs at TP = 1 and TP = 2 equal the Hugging Face model's
  (``trainer.learner.backends.torch.response_logprobs``) within 1e-5 in fp32, at temperature 1 and
  0.7, on a left/right padded multi-turn batch; critic values equal ``ValueModel``'s.
* model-dependent sizes are refused with the key named; the CPU shims are idempotent and the
  version pin is asserted.
"""

from __future__ import annotations

import os

import pytest
import torch

from trainer.learner.backends.megatron.shims import MegatronVersionError, check_versions
from trainer.learner.backends.torch import mb_values, response_logprobs
from trainer.learner.critic import ValueModel
from trainer.models.tiny import TinyModelConfig, build_byte_tokenizer, save_tiny_checkpoint
from trainer.rollout.batch import RolloutBatch, to_batch
from trainer.rollout.trajectory import Trajectory

try:
    from .test_megatron_group import RankPool
except ImportError:  # run by path inside a rank process (RankPool's loader): no package, siblings by name
    from test_megatron_group import RankPool

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def pool():
    p = RankPool(2, timeout_s=300)
    yield p
    p.close()


def save_tiny_qwen3(out) -> str:
    """A tiny Qwen3 (q/k RMSNorm, untied LM head) with the byte tokenizer."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    tok = build_byte_tokenizer()
    torch.manual_seed(3)
    model = Qwen3ForCausalLM(Qwen3Config(vocab_size=len(tok), hidden_size=64, intermediate_size=128,
                                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                         head_dim=16, max_position_embeddings=512, tie_word_embeddings=False))
    model.float().save_pretrained(out)
    tok.save_pretrained(out)
    return str(out)


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("megatron_bridge")
    return {"qwen2": str(save_tiny_checkpoint(root / "qwen2", TinyModelConfig(arch="qwen2", seed=0))),
            "llama": str(save_tiny_checkpoint(root / "llama", TinyModelConfig(arch="llama", seed=1))),
            "qwen3": save_tiny_qwen3(root / "qwen3")}


def padded_batch() -> RolloutBatch:
    """3 two-turn episodes of different prompt and response lengths (left- and right-padding)."""
    g = torch.Generator().manual_seed(0)
    trs = []
    for i, (p, n) in enumerate([(2, 9), (5, 4), (3, 7)]):
        ids = torch.randint(0, 256, (p + n + 1,), generator=g).tolist()
        tr = Trajectory(prompt_ids=ids[:p], sample_id=i, group_id=i)
        tr.append_model_tokens(ids[p:p + 2], [-5.0] * 2, 0)
        tr.append_observation_tokens(ids[p + 2:p + 3])
        tr.append_model_tokens(ids[p + 3:], [-5.0] * len(ids[p + 3:]), 0)
        trs.append(tr)
    return to_batch(trs, 257)


def hf_model(path: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


# -- rank side ---------------------------------------------------------------------------------
def _ctx(state: dict, tp: int):
    import torch.distributed as dist

    from trainer.learner.distributed.base import RankContext

    r, w = state["rank"], state["world_size"]
    return RankContext(rank=r, world_size=w, tp_size=tp, cpu_group=dist.group.WORLD,
                       **RankContext.layout(r, w, tp))


def _models(state: dict, path: str, tp: int):
    """(bridge, actor, critic) for ``path`` at tensor-parallel size ``tp`` (cached per rank)."""
    key = ("models", path, tp)
    if key not in state:
        from trainer.learner.backends.megatron import bridge as mb
        from trainer.learner.backends.megatron import shims
        from trainer.learner.backends.megatron.rank_learner import init_parallel_state

        shims.check_versions()
        shims.apply_cpu_shims()
        init_parallel_state(_ctx(state, tp))
        br = mb.make_bridge(path, torch.float32)
        cpu = torch.device("cpu")
        state[key] = (br, mb.build_actor(br, path, cpu), mb.build_critic(br, path, cpu))
    else:
        from trainer.learner.backends.megatron.rank_learner import init_parallel_state

        init_parallel_state(_ctx(state, tp))
    return state[key]


def _r_export(state: dict, path: str, tp: int):
    from trainer.learner.backends.megatron.bridge import export_actor, export_critic

    br, actor, critic = _models(state, path, tp)
    return dict(export_actor(br, actor)), dict(export_critic(br, critic))


def _r_forward(state: dict, path: str, tp: int, batch: RolloutBatch, temperature: float,
               head: tuple[torch.Tensor, torch.Tensor]):
    from trainer.learner.backends.megatron.logprobs import response_logprobs as mlp
    from trainer.learner.backends.megatron.logprobs import response_values

    _, actor, critic = _models(state, path, tp)
    with torch.no_grad():
        critic.output_layer.weight.copy_(head[0])
        critic.output_layer.bias.copy_(head[1])
        cpu = torch.device("cpu")
        return mlp(actor, batch, temperature, cpu), response_values(critic, batch, cpu)


def _r_shims(state: dict):
    """Apply every shim twice; what the second application left."""
    import contextlib
    import queue

    from megatron.core.dist_checkpointing.strategies import filesystem_async
    from megatron.core.tensor_parallel import random as mrandom

    from trainer.learner.backends.megatron import shims

    seen = []
    for _ in range(2):
        assert shims.apply_cpu_shims() is True
        shims.apply_checkpoint_shims()
        seen.append((torch.cuda.current_device(), type(mrandom.get_cuda_rng_tracker()).__name__,
                     id(mrandom.get_cuda_rng_tracker())))
    torch.cuda.synchronize()  # a no-op now (the checkpoint writer calls it)
    fork = mrandom.get_cuda_rng_tracker().fork()
    return (seen, isinstance(fork, contextlib.nullcontext), os.environ.get("TORCHDYNAMO_DISABLE"),
            isinstance(filesystem_async._get_write_results_queue(), queue.Queue))


def _r_check_sizes(state: dict, path: str):
    from trainer.errors import ConfigError
    from trainer.learner.backends.megatron.bridge import check_model_parallel, load_hf_config

    cfg, out = load_hf_config(path), []
    for tp, pp in ((4, 1), (3, 1), (2, 2)):
        try:
            check_model_parallel(cfg, tp, pp)
            out.append(None)
        except ConfigError as e:
            out.append(str(e))
    return out


# -- tests -------------------------------------------------------------------------------------
@pytest.mark.parametrize("arch,tp", [("qwen2", 2), ("llama", 2), ("qwen3", 2), ("qwen2", 1)])
def test_hf_megatron_hf_round_trip_is_bit_exact(pool, ckpts, arch, tp):
    ref = hf_model(ckpts[arch])
    (actor0, critic0), (actor1, _) = pool.run(_r_export, ckpts[arch], tp)
    want = ref.state_dict()
    assert set(actor0) == set(want)  # the transformers names, a tied lm_head.weight included
    for name, t in want.items():
        assert actor0[name].dtype == t.dtype and torch.equal(actor0[name], t), name
        assert torch.equal(actor1[name], t), name  # every TP rank gathers the same full tensors
    critic_ref = ValueModel.from_causal_lm(ref).state_dict()
    assert set(critic0) == set(critic_ref)
    for name, t in critic_ref.items():
        assert torch.equal(critic0[name], t), name
    assert float(critic0["value_head.weight"].abs().sum()) == 0.0  # the torch backend's zero head


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
@pytest.mark.parametrize("tp", [1, 2])
def test_vocab_parallel_logprobs_and_values_equal_hugging_face(pool, ckpts, arch, tp):
    batch, ref = padded_batch(), hf_model(ckpts[arch])
    critic = ValueModel.from_causal_lm(ref)
    g = torch.Generator().manual_seed(1)
    head = (torch.randn(1, ref.config.hidden_size, generator=g), torch.randn(1, generator=g))
    with torch.no_grad():
        critic.value_head.weight.copy_(head[0])
        critic.value_head.bias.copy_(head[1])
        ref_values = mb_values(critic, batch)
    mask = batch.loss_mask.bool()
    assert mask.sum() == 9 + 4 + 7  # model tokens only (one observation token per episode)
    for temperature in (1.0, 0.7):
        with torch.no_grad():
            want = response_logprobs(ref, batch, temperature)
        (lp0, v0), (lp1, _) = pool.run(_r_forward, ckpts[arch], tp, batch, temperature, head)
        assert lp0.shape == want.shape == v0.shape
        assert float((lp0 - want)[mask].abs().max()) < 1e-5
        assert torch.equal(lp0, lp1)  # identical on the tensor-parallel ranks
        assert float((v0 - ref_values)[mask].abs().max()) < 1e-5
        assert float(want[mask].std()) > 0.1  # the log-probs are not a constant
    assert float(ref_values[mask].std()) > 0.01


def test_model_dependent_sizes_name_the_key(pool, ckpts):
    errs = pool.run(_r_check_sizes, ckpts["qwen2"])[0]  # 4 heads, 2 key/value heads, 258 tokens
    assert "learner.backend_settings.tensor_parallel_size=4" in errs[0] and "2 key/value heads" in errs[0]
    assert "learner.backend_settings.tensor_parallel_size=3" in errs[1] and "4 attention heads" in errs[1]
    assert "learner.backend_settings.pipeline_parallel_size=2" in errs[2]


def test_cpu_shims_are_idempotent_and_replace_the_cuda_calls(pool):
    seen, null_fork, dynamo_off, plain_queue = pool.run(_r_shims)[1]
    assert seen[0] == seen[1] and seen[0][0] == torch.device("cpu")  # same tracker object: not re-created
    assert seen[0][1] == "InferenceCudaRNGStatesTracker" and null_fork
    assert dynamo_off == "1" and plain_queue


def test_version_pin_is_asserted_with_the_install_hint():
    check_versions()  # the installed megatron-core 0.16.1 / mbridge 0.15.1
    with pytest.raises(MegatronVersionError, match=r"megatron-core==9\.9 .*found 0\.16\.1.*\[megatron\]"):
        check_versions({"megatron-core": "9.9"})
    with pytest.raises(MegatronVersionError, match=r"no-such-dist==1\.0.*not installed"):
        check_versions({"no-such-dist": "1.0"})
