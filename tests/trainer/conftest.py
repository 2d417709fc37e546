"""Fixtures for trainer tests: a tiny offline checkpoint (helpers in this folder importable)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from environments.sandbox import Sandbox, SandboxConfig
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


@pytest.fixture(scope="module")
def sandbox():
    """A 2-worker bwrap sandbox pool shared by one test module."""
    sb = Sandbox(SandboxConfig(workers=2))
    yield sb
    sb.close()


@pytest.fixture(scope="module")
def one_torch_thread():
    """Tiny models gain nothing from intra-op threads, and on a busy 2-core box (sandbox workers,
    retriever server, other tests) OpenMP spin-waiting makes them ~15x slower. Use it with
    ``pytestmark = pytest.mark.usefixtures("one_torch_thread")``."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def smollm2_tokenizer(realmodel_path):
    """SmolLM2-135M-Instruct's real tokenizer (49,152 tokens, ChatML template), from the pulled model."""
    from trainer.models.loading import load_tokenizer

    return load_tokenizer(realmodel_path)
