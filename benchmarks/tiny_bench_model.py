"""The tiny Qwen2 model the engine and evaluation benchmarks measure (built offline, seeded)."""

from __future__ import annotations

import tempfile
from typing import Any

import torch

from trainer.models.loading import load_model_and_tokenizer
from trainer.models.tiny import TinyModelConfig, save_tiny_checkpoint


def tiny_bench_model(hidden: int, layers: int) -> tuple[Any, Any, TinyModelConfig, int]:
    """``(model, tokenizer, config, n_params)`` of a random tiny Qwen2: ``hidden`` width,
    ``layers`` layers, MLP ``4·hidden``, one head per 64 dims, one KV head per 128 (torch seed 0)."""
    torch.manual_seed(0)
    cfg = TinyModelConfig(hidden_size=hidden, intermediate_size=4 * hidden, num_layers=layers,
                          num_heads=max(1, hidden // 64), num_kv_heads=max(1, hidden // 128))
    with tempfile.TemporaryDirectory() as d:
        model, tok = load_model_and_tokenizer(save_tiny_checkpoint(d, cfg))
    return model, tok, cfg, sum(p.numel() for p in model.parameters())
