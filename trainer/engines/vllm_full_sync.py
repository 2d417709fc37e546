"""The ``vllm`` engine for a policy without LoRA: full-weight sync by an in-place reload.

:func:`vllm_full_weight_engine` (called by :func:`~.vllm_factory.vllm_engine` when the spec has no
adapter) starts the server with ``reload_weights`` (``VLLM_SERVER_DEV_MODE=1`` and our worker
extension, ``trainer/engines/vllm_ext/copc_vllm_ext.py``). Each ``sync(weights, version)`` writes the
weights as a Hugging Face checkpoint ``<work_dir>/vllm_weights/v<version>`` (safetensors in the model
dir's layout), and :meth:`~.vllm.VLLMEngine.update_weights` reloads it in place with all requests
drained (``/pause?mode=wait`` → ``/collective_rpc copc_reload_weights`` → ``/resume``); the previous
version's directory is then removed. The extension repacks a tied output head after vLLM's own
``reload_weights``, which on CPU leaves the head computing with the old weights (docs/engines.md).
"""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path

from .registry import EngineHandle, EngineSpec, Weights


def vllm_full_weight_engine(spec: EngineSpec) -> EngineHandle:
    """A vLLM server on ``spec.model_dir`` (or on ``spec.weights`` written next to the synced
    versions), or the one at ``settings.url`` with those weights reloaded into it
    (:mod:`.vllm_attach`), and a client whose ``sync`` reloads full weights in place.

    Args:
        spec: the engine spec, ``spec.adapter`` None, ``spec.settings`` a
            :class:`~.vllm_factory.VLLMSettings`.

    Returns:
        The handle (``sync_adapter`` None: weights move whole).

    Raises:
        VLLMLaunchError: the venv is missing or the server cannot start (with its log's tail), or
            the server at ``settings.url`` cannot serve this run.
        EngineError: the attached server failed to reload the start weights.
        RuntimeError: ``spec.weights`` do not match the model's architecture.
    """
    from ..models.export import save_hf_weights
    from .vllm import VLLMEngine, VLLMEngineConfig
    from .vllm_attach import start_or_attach
    from .vllm_launcher import VLLMLauncherConfig

    s = spec.settings
    root = (spec.work_dir or spec.model_dir.parent) / "vllm_weights"
    start = spec.model_dir
    if spec.weights is not None:  # e.g. a resumed full fine-tune: the server starts on them
        start = save_hf_weights(spec.weights, spec.model_dir, root / f"v{spec.version}")
    launcher = start_or_attach(s.url, VLLMLauncherConfig(
        model_path=str(spec.model_dir if s.url else start), python=s.python, port=s.port or None,
        dtype=s.dtype, max_model_len=s.max_model_len, kv_cache_gib=s.kv_cache_gib,
        enforce_eager=s.enforce_eager, reload_weights=True, startup_timeout_s=s.startup_timeout_s,
        log_tail_lines=s.log_tail_lines, log_path=str(root.parent / "vllm_server.log")))
    config = VLLMEngineConfig(base_url=launcher.url, request_timeout_s=s.request_timeout_s,
                              max_retries=s.max_retries, vocab_size=len(spec.tokenizer),
                              initial_version=spec.version)
    if s.url:  # a server we did not start may hold another run's weights: load the start ones
        reload_now(config, start, spec.version)
    engine = VLLMEngine(config)
    engine.launcher = launcher  # the server process (tests end it to check the client's error)
    served: list[Path] = []  # the directory of the weights served now (the start directory is kept)

    async def sync(weights: Weights, version: int) -> None:
        d = await asyncio.to_thread(save_hf_weights, weights, spec.model_dir, root / f"v{version}")
        await engine.update_weights(d, version)
        for old in [p for p in served if p != d]:  # loaded into the server's memory: not read again
            await asyncio.to_thread(shutil.rmtree, old, True)
        served[:] = [d]

    async def close() -> None:
        await engine.close()
        await asyncio.to_thread(launcher.close)

    return EngineHandle(engine, sync, close)


def reload_now(config, weights_dir: Path, version: int) -> None:
    """Reload ``weights_dir`` (a Hugging Face model directory, or ``*.safetensors`` in its names) into
    the server of ``config`` (a :class:`~.vllm.VLLMEngineConfig`) as ``version``, requests drained,
    from a thread of its own (the factory may be called where an event loop runs).

    Raises:
        EngineError: the server refused or failed.
    """
    from concurrent.futures import ThreadPoolExecutor

    from .vllm import VLLMEngine

    async def reload() -> None:
        engine = VLLMEngine(config)
        try:
            await engine.update_weights(weights_dir, version)
        finally:
            await engine.close()

    with ThreadPoolExecutor(1) as pool:
        pool.submit(asyncio.run, reload()).result()
