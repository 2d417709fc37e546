"""LoRA target modules that are not linear layers are refused (issue 42 item 4.3).

``embed_tokens`` in ``learner.lora.target_modules`` used to be accepted: peft put
``lora_embedding_A/B`` on the (tied) input embedding, the learner never trained them (it trains
``lora_A`` / ``lora_B``), and peft's adapter state dict carried the whole embedding matrix, so every
adapter-only sync sent it. Now it fails at config load, one line naming the key; any other
non-linear module a target matches fails at model load.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from trainer.config import ConfigError, load_config
from trainer.models.loading import load_model_and_tokenizer
from trainer.models.lora import LoraSettings, check_target_modules, inject_lora
from trainer.models.tiny import TinyModelConfig, save_tiny_checkpoint

WHY = ("'embed_tokens' is the input embedding, not a linear layer: its adapter would never be trained "
       "(tied to lm_head on tied models) and the whole embedding matrix would be sent in every "
       "adapter-only sync")


@pytest.mark.parametrize(("override", "key", "value"), [
    ("learner.lora.target_modules=[q_proj,embed_tokens]", "learner.lora", "['q_proj', 'embed_tokens']"),
    ("learner.critic_lora.target_modules=[embed_tokens]", "learner.critic_lora", "['embed_tokens']"),
])
def test_embed_tokens_refused_at_config_load_naming_the_key(override, key, value):
    with pytest.raises(ConfigError) as e:
        load_config(None, [override])
    assert str(e.value) == f"{key}.target_modules={value}: {WHY}"


def test_embed_tokens_refused_by_the_settings():
    with pytest.raises(ValueError, match=r"^target_modules=\['embed_tokens'\]: 'embed_tokens' is the input"):
        LoraSettings(target_modules=("embed_tokens",))


class _Tied(nn.Module):
    """A GPT-2-like toy: an input embedding ``wte`` (another name than embed_tokens), a projection."""

    def __init__(self) -> None:
        super().__init__()
        self.wte, self.proj = nn.Embedding(11, 4), nn.Linear(4, 4)


def test_a_non_linear_target_is_refused_at_model_load():
    key = "learner.lora.target_modules"
    with pytest.raises(ConfigError) as e:
        check_target_modules(_Tied(), LoraSettings(target_modules=("proj", "wte")), key)
    assert str(e.value) == (f"{key}: 'wte' matches 'wte', a Embedding, not an nn.Linear: LoRA here adapts "
                            "linear layers only (an adapter there would not be trained or merged)")
    check_target_modules(_Tied(), LoraSettings(target_modules=("proj",)), "learner.lora.target_modules")


def test_a_block_target_on_a_real_tiny_model_names_the_block(tmp_path):
    path = save_tiny_checkpoint(tmp_path / "tiny", TinyModelConfig(hidden_size=32, intermediate_size=64,
                                                                   num_layers=1))
    model, _ = load_model_and_tokenizer(str(path))
    assert model.config.tie_word_embeddings  # the tiny model is tied, as SmolLM2
    with pytest.raises(ConfigError, match=r"^learner\.lora\.target_modules: 'mlp' matches "
                                          r"'model\.layers\.0\.mlp', a Qwen2MLP, not an nn\.Linear"):
        inject_lora(model, LoraSettings(target_modules=("q_proj", "mlp")))
    # a linear target: the adapter holds lora_A / lora_B only, no embedding matrix
    inject_lora(model, LoraSettings(rank=2, target_modules=("q_proj",)))
    trainable = sorted(n for n, p in model.named_parameters() if p.requires_grad)
    assert trainable == ["model.layers.0.self_attn.q_proj.lora_A.default.weight",
                         "model.layers.0.self_attn.q_proj.lora_B.default.weight"]
    assert all(p.dtype == torch.float32 for p in model.parameters() if p.requires_grad)
