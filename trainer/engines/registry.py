"""The engine seam: ``rollout.engine`` names a registered factory; nothing else branches on it.

A factory turns an :class:`EngineSpec` (the experiment config, the policy's model directory,
the tokenizer, the initial policy version and weights, a work directory) into an
:class:`EngineHandle`: the :class:`~trainer.engines.base.InferenceEngine` plus how to push a
learner's weights to it and how to shut it down. The driver, the Ray rollout workers and
evaluation all build engines through :func:`make_engine`.

Built in (registered in :mod:`trainer.engines`): ``embedded`` (in-process, CPU default) and
``sglang`` (a launched SGLang server, GPU). Adding an engine = one module with a factory +
one :func:`register_engine` call (optionally a ``preflight`` that rejects a config early).
The registry is a :class:`seams.registry.Registry` (the one registry class of the house).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from seams.registry import Registry

from .base import InferenceEngine, SamplingParams

if TYPE_CHECKING:  # the registry is read when a config is validated: no torch at import
    import torch

    from ..models.lora import AdapterWeights

#: ``(name, tensor)`` pairs in Hugging Face names (what ``Learner.export_policy_weights`` yields).
Weights = Iterable[tuple[str, "torch.Tensor"]]


@dataclass
class EngineSpec:
    """What an engine factory gets: a typed spec built once where the run is assembled
    (:func:`trainer.config.specs.engine_spec` reads the experiment config), never the config itself.

    Attributes:
        model_dir: ``save_pretrained`` directory with the policy's architecture (and weights).
        tokenizer: the policy tokenizer.
        version: policy version of the initial weights.
        weights: initial weights overriding those in ``model_dir`` (e.g. a resumed learner's),
            or None.
        work_dir: a directory the engine may write to (weight snapshots for disk sync, logs).
        settings: the engine's own settings (an instance of the dataclass it was registered
            with, built from ``rollout.engine_settings`` by :func:`make_engine`), or None.
        adapter: the initial LoRA adapter of a LoRA policy (:class:`~trainer.models.lora.AdapterWeights`:
            the engine serves ``model_dir``'s weights with it, and later syncs send adapters only),
            or None (full weights).
        dtype: the policy's parameter dtype, ``float32`` | ``bfloat16`` | ``float16`` (``model.dtype``).
        attn_implementation: ``eager`` | ``sdpa`` | ``flash_attention_2`` (``model.attn_implementation``).
        max_batch_size: sequences an in-process engine decodes at once (``rollout.engine_max_batch_size``).
        fixed_lag: the run's fixed lag k (``train.staleness`` mode ``fixed``), None under bounded
            staleness (a server engine keeps the k + 1 versions a batch may still use).
    """

    model_dir: Path
    tokenizer: Any
    version: int = 0
    weights: Weights | None = None
    work_dir: Path | None = None
    settings: Any = None
    adapter: AdapterWeights | None = None
    dtype: str = "float32"
    attn_implementation: str = "eager"
    max_batch_size: int = 32
    fixed_lag: int | None = None


@dataclass
class EngineHandle:
    """A started engine.

    Attributes:
        engine: the :class:`InferenceEngine` rollouts call.
        sync: ``await sync(weights, version)`` makes the engine generate with ``weights``
            (Hugging Face names) as policy ``version``; returns when new requests use them.
        close: ``await close()`` stops the engine and anything it started (idempotent).
        sync_adapter: ``await sync_adapter(adapter, version)`` makes the engine generate with the
            base weights and LoRA ``adapter`` (:class:`~trainer.models.lora.AdapterWeights`) as policy
            ``version``, moving the adapter only; None: the engine takes full weights only (a LoRA
            policy then reaches it merged, through ``sync``).
    """

    engine: InferenceEngine
    sync: Callable[[Weights, int], Awaitable[None]]
    close: Callable[[], Awaitable[None]]
    sync_adapter: Callable[[AdapterWeights, int], Awaitable[None]] | None = None


EngineFactory = Callable[[EngineSpec], EngineHandle]


@dataclass(frozen=True)
class EngineCheck:
    """What an engine's ``preflight`` gets: the run's settings that decide whether the engine can
    serve it, built once by :func:`trainer.config.specs.preflight_engine` (never the config).

    Attributes:
        settings: the engine's own settings (its registered dataclass, from
            ``rollout.engine_settings``), or None for an engine without settings.
        sampling: the rollouts' sampling parameters (``rollout.temperature`` / ``top_p`` /
            ``top_k`` / ``max_new_tokens``).
        lora: the policy is a LoRA adapter (``learner.lora``): syncs move the adapter only.
        fixed_lag: the exact staleness ``k`` of ``train.staleness: {mode: fixed}`` (the engine then
            generates with version ``n - k`` while the learner is at ``n``), or None (bounded mode).
        rollout_workers: the launcher runs rollouts in worker processes of its own, each making its
            own engine (its ``rollout_workers`` capability, e.g. ``ray``); ``launcher`` its name.
    """

    settings: Any = None
    sampling: SamplingParams = dataclasses.field(default_factory=SamplingParams)
    lora: bool = False
    fixed_lag: int | None = None
    rollout_workers: bool = False
    launcher: str = "local"


#: Capability metadata of an engine registration: ``preflight`` (``preflight(check)``, ``check`` an
#: :class:`EngineCheck`, raising :class:`~trainer.errors.ConfigError` when the engine cannot run
#: this run on this machine, checked before any work by
#: :func:`trainer.config.specs.preflight_engine`; None: no check).
ENGINE_METADATA = {"preflight": ((type(None), Callable), None)}

#: The engine registry, ``rollout.engine`` → factory (``embedded`` and ``sglang`` are registered
#: by :mod:`trainer.engines`); a :class:`seams.registry.Registry`.
ENGINES: Registry[EngineFactory] = Registry("engine", ENGINE_METADATA, key="rollout.engine")


def register_engine(name: str, factory: EngineFactory, *, preflight: Callable[..., None] | None = None,
                    settings: type | None = None, overwrite: bool = False, **metadata: Any) -> EngineFactory:
    """Register ``factory`` as engine ``name`` in :data:`ENGINES`.

    Args:
        name: the value of ``rollout.engine``.
        factory: ``factory(spec) -> EngineHandle`` (may block while a server starts).
        preflight: ``preflight(check)`` (an :class:`EngineCheck`) raising
            :class:`~trainer.config.ConfigError` when the engine cannot run this run on this
            machine (checked before any work).
        settings: the engine's settings dataclass (``rollout.engine_settings``), or None.
        overwrite: replace an existing registration.
        **metadata: further capability metadata of :data:`ENGINE_METADATA`.

    Returns:
        ``factory``.

    Raises:
        seams.registry.RegistryError: (a ``ValueError``) empty name, or ``name`` taken and
            ``overwrite`` is False.
    """
    return ENGINES.register(name, factory, preflight=preflight, settings=settings, overwrite=overwrite,
                            **metadata)


def make_engine(name: str, spec: EngineSpec) -> EngineHandle:
    """Start engine ``name`` from :data:`ENGINES` (blocking; call through ``asyncio.to_thread``
    from async code when it may take long).

    ``spec.settings`` takes the engine's default settings when it has a settings dataclass and
    the spec carries none (:func:`trainer.config.specs.engine_spec` fills them from
    ``rollout.engine_settings``).

    Raises:
        seams.registry.RegistryError: unknown engine (the message lists the registered ones).
    """
    factory = ENGINES.get(name)
    if spec.settings is None and ENGINES.settings_type(name) is not None:
        defaults = ENGINES.build_settings(name, None, "rollout.engine_settings")
        spec = dataclasses.replace(spec, settings=defaults)
    return factory(spec)
