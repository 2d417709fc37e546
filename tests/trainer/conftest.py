"""Fixtures for trainer tests: a tiny offline checkpoint (helpers in this folder importable)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from trainer.models.loading import load_model_and_tokenizer
from trainer.models.tiny import TinyModelConfig, save_tiny_checkpoint

sys.path.insert(0, str(Path(__file__).resolve().parent))


@pytest.fixture(scope="session")
def tiny_ckpt(tmp_path_factory) -> str:
    """Path of a tiny Qwen2 checkpoint with the byte tokenizer, saved with save_pretrained."""
    return str(save_tiny_checkpoint(tmp_path_factory.mktemp("tiny"), TinyModelConfig(seed=0)))


@pytest.fixture
def model_tok(tiny_ckpt):
    """A fresh (model, tokenizer) loaded through the ``model.path`` code path."""
    return load_model_and_tokenizer(tiny_ckpt)
