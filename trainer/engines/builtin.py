"""Factories of the built-in engines, registered under ``embedded`` and ``sglang``.

See :mod:`trainer.engines.registry` for the protocol. Heavy imports happen inside the
factories, so registering costs nothing (a config is validated without torch).
"""

from __future__ import annotations

import asyncio
import importlib.util
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .registry import EngineHandle, EngineSpec, Weights

if TYPE_CHECKING:
    from ..models.lora import AdapterWeights


def embedded_engine(spec: EngineSpec) -> EngineHandle:
    """In-process :class:`~trainer.engines.embedded.EmbeddedEngine` on its own copy of the policy.

    Weight sync copies the exported tensors into the engine's model between decode rounds; with
    ``spec.adapter`` (a LoRA policy) the engine serves ``model_dir``'s weights with that adapter and
    adapter syncs copy the adapter's tensors only.
    """
    import torch

    from ..models.loading import load_model_and_tokenizer
    from .embedded import EmbeddedEngine, EmbeddedEngineConfig

    model, _ = load_model_and_tokenizer(spec.model_dir, dtype=getattr(torch, spec.dtype),
                                        attn_implementation=spec.attn_implementation)
    if spec.weights is not None:
        model.load_state_dict(dict(spec.weights), strict=True)
    engine = EmbeddedEngine(model, spec.tokenizer, EmbeddedEngineConfig(max_batch_size=spec.max_batch_size),
                            version=spec.version, adapter=spec.adapter)

    async def sync(weights: Weights, version: int) -> None:
        await engine.update_weights(dict(weights), version)

    return EngineHandle(engine, sync, engine.close, sync_adapter=engine.update_adapter)


@dataclass(frozen=True)
class SGLangSettings:
    """The ``sglang`` engine's own settings (``rollout.engine_settings`` with ``rollout.engine:
    sglang``): a server of ``tp × dp`` GPUs from ``base_gpu_id`` on.

    Attributes:
        port: the server's port on 127.0.0.1 (1..65535). tp / dp: tensor / data-parallel
            size of the server (>= 1). base_gpu_id: first GPU (>= 0). mem_fraction: the
            share of each GPU's memory SGLang may hold statically, in (0, 1].

    Raises:
        ValueError: a value out of range, naming the field.
    """

    port: int = 30000
    tp: int = 1
    dp: int = 1
    base_gpu_id: int = 0
    mem_fraction: float = 0.8

    def __post_init__(self) -> None:
        if not 1 <= self.port <= 65535:
            raise ValueError(f"port={self.port!r}: must be in 1..65535")
        for k in ("tp", "dp"):
            if getattr(self, k) < 1:
                raise ValueError(f"{k}={getattr(self, k)!r}: must be >= 1")
        if self.base_gpu_id < 0:
            raise ValueError(f"base_gpu_id={self.base_gpu_id!r}: must be >= 0")
        if not 0.0 < self.mem_fraction <= 1.0:
            raise ValueError(f"mem_fraction={self.mem_fraction!r}: must be in (0, 1]")


def sglang_preflight(check: object) -> None:
    """SGLang needs untruncated sampling (its log-probs are not those of a top-k / top-p
    distribution: :func:`~trainer.engines.sglang_protocol.check_sampling` on ``check.sampling``,
    ``check`` an :class:`~trainer.engines.registry.EngineCheck`), a CUDA GPU and the ``sglang`` package.

    Raises:
        ConfigError: naming ``rollout.top_p`` / ``top_k`` or ``rollout.engine`` and how to fix it.
    """
    import torch

    from ..errors import ConfigError
    from .sglang_protocol import check_sampling

    sampling = getattr(check, "sampling", None)
    if sampling is not None:
        try:
            check_sampling(sampling)
        except ValueError as e:
            raise ConfigError(str(e)) from None

    if importlib.util.find_spec("sglang") is None or not torch.cuda.is_available():
        raise ConfigError("rollout.engine='sglang' needs a CUDA GPU and the sglang package "
                          "(pip install -e .[gpu]); use rollout.engine=embedded on CPU")


def sglang_engine(spec: EngineSpec) -> EngineHandle:
    """An SGLang server launched by us (its own process group) and an HTTP client for it.

    The server starts from a ``save_pretrained`` snapshot of the initial weights; weight sync
    writes a snapshot per version under ``work_dir/sglang_weights/v<N>`` and calls
    ``/update_weights_from_disk``. With ``spec.adapter`` (a LoRA policy) the server starts on
    ``model_dir`` with LoRA enabled for the adapter's rank and modules and the adapter loaded
    (``--lora-paths``); adapter syncs write the adapter (PEFT layout) to
    ``work_dir/sglang_weights/lora_v<N>`` and call ``/load_lora_adapter`` (the previous directory is
    removed once the server has loaded the new one).
    """
    import shutil

    from ..models.export import save_hf_weights
    from .sglang import SGLangEngine, SGLangEngineConfig
    from .sglang_launcher import SGLangLauncher, SGLangLauncherConfig
    from .sglang_lora import adapter_name

    r: SGLangSettings = spec.settings
    root = (spec.work_dir or spec.model_dir.parent) / "sglang_weights"
    start_dir = spec.model_dir
    if spec.weights is not None:
        start_dir = save_hf_weights(spec.weights, spec.model_dir, root / f"v{spec.version}")
    lora: dict[str, Any] = {}
    initial = None
    if spec.adapter is not None:
        a, initial = spec.adapter, adapter_name(0, spec.version)
        d = a.save_peft_dir(root / f"lora_v{spec.version}", spec.model_dir)
        mods = ("all",) if a.settings.target_modules == ("all-linear",) else tuple(a.module_names)
        lora = {"lora_max_rank": a.settings.rank, "lora_target_modules": mods,
                "lora_paths": (f"{initial}={d}",)}
    launcher = SGLangLauncher(SGLangLauncherConfig(model_path=str(start_dir), port=r.port,
                                                   tp=r.tp, dp=r.dp, base_gpu_id=r.base_gpu_id,
                                                   mem_fraction_static=r.mem_fraction, **lora))
    launcher.start()
    engine = SGLangEngine(SGLangEngineConfig(base_url=launcher.url, initial_version=spec.version,
                                             vocab_size=len(spec.tokenizer), initial_lora=initial))
    served = [root / f"lora_v{spec.version}"] if initial else []

    async def sync(weights: Weights, version: int) -> None:
        d = await asyncio.to_thread(save_hf_weights, weights, spec.model_dir, root / f"v{version}")
        await engine.update_weights(str(d), version)

    async def sync_adapter(adapter: AdapterWeights, version: int) -> None:
        d = await asyncio.to_thread(adapter.save_peft_dir, root / f"lora_v{version}", spec.model_dir)
        await engine.load_adapter(d, version)
        for old in [p for p in served if p != d]:  # SGLang holds a loaded adapter in memory
            await asyncio.to_thread(shutil.rmtree, old, True)
        served[:] = [d]

    async def close() -> None:
        await engine.close()
        await asyncio.to_thread(launcher.close)

    return EngineHandle(engine, sync, close, sync_adapter=sync_adapter if initial else None)
