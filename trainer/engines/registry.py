"""The engine seam: ``rollout.engine`` names a registered factory; nothing else branches on it.

A factory turns an :class:`EngineSpec` (the experiment config, the policy's model directory,
the tokenizer, the initial policy version and weights, a work directory) into an
:class:`EngineHandle`: the :class:`~trainer.engines.base.InferenceEngine` plus how to push a
learner's weights to it and how to shut it down. The driver, the Ray rollout workers and
evaluation all build engines through :func:`make_engine`.

Built in (registered in :mod:`trainer.engines`): ``embedded`` (in-process, CPU default) and
``sglang`` (a launched SGLang server, GPU). Adding an engine = one module with a factory +
one :func:`register_engine` call (optionally a ``preflight`` that rejects a config early).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .base import InferenceEngine

#: ``(name, tensor)`` pairs in Hugging Face names (what ``Learner.export_policy_weights`` yields).
Weights = Iterable[tuple[str, torch.Tensor]]


@dataclass
class EngineSpec:
    """What an engine factory gets.

    Attributes:
        exp: the :class:`~trainer.config.ExperimentConfig` (``rollout`` and ``model`` sections).
        model_dir: ``save_pretrained`` directory with the policy's architecture (and weights).
        tokenizer: the policy tokenizer.
        version: policy version of the initial weights.
        weights: initial weights overriding those in ``model_dir`` (e.g. a resumed learner's),
            or None.
        work_dir: a directory the engine may write to (weight snapshots for disk sync, logs).
    """

    exp: Any
    model_dir: Path
    tokenizer: Any
    version: int = 0
    weights: Weights | None = None
    work_dir: Path | None = None


@dataclass
class EngineHandle:
    """A started engine.

    Attributes:
        engine: the :class:`InferenceEngine` rollouts call.
        sync: ``await sync(weights, version)`` makes the engine generate with ``weights``
            (Hugging Face names) as policy ``version``; returns when new requests use them.
        close: ``await close()`` stops the engine and anything it started (idempotent).
    """

    engine: InferenceEngine
    sync: Callable[[Weights, int], Awaitable[None]]
    close: Callable[[], Awaitable[None]]


EngineFactory = Callable[[EngineSpec], EngineHandle]


@dataclass(frozen=True)
class _Entry:
    factory: EngineFactory
    preflight: Callable[[Any], None] | None


class EngineRegistry:
    """Name → engine factory (``rollout.engine``)."""

    def __init__(self) -> None:
        self._entries: dict[str, _Entry] = {}

    def register(self, name: str, factory: EngineFactory, *, preflight: Callable[[Any], None] | None = None,
                 overwrite: bool = False) -> None:
        """Register ``factory`` as engine ``name``.

        Args:
            name: the value of ``rollout.engine``.
            factory: ``factory(spec) -> EngineHandle`` (may block while a server starts).
            preflight: ``preflight(exp_cfg)`` raising :class:`~trainer.config.ConfigError` when
                the engine cannot run with this config on this machine (checked before any work).
            overwrite: replace an existing registration.

        Raises:
            ValueError: empty name, or ``name`` taken and ``overwrite`` is False.
        """
        if not isinstance(name, str) or not name:
            raise ValueError(f"engine name must be a non-empty str, got {name!r}")
        if name in self._entries and not overwrite:
            raise ValueError(f"engine {name!r} is already registered (pass overwrite=True)")
        self._entries[name] = _Entry(factory, preflight)

    def names(self) -> list[str]:
        """Registered engine names, sorted."""
        return sorted(self._entries)

    def _entry(self, name: str) -> _Entry:
        if name not in self._entries:
            raise KeyError(f"rollout.engine={name!r}: not registered; known: {self.names()}")
        return self._entries[name]

    def preflight(self, name: str, exp_cfg: Any) -> None:
        """Run engine ``name``'s preflight check on ``exp_cfg`` (no-op without one).

        Raises:
            KeyError: unknown engine. ConfigError: from the check.
        """
        entry = self._entry(name)
        if entry.preflight is not None:
            entry.preflight(exp_cfg)

    def make(self, name: str, spec: EngineSpec) -> EngineHandle:
        """Start engine ``name`` (blocking; call through ``asyncio.to_thread`` from async code
        when it may take long).

        Raises:
            KeyError: unknown engine (the message lists the registered ones).
        """
        return self._entry(name).factory(spec)


#: The default registry (``embedded`` and ``sglang`` are registered by :mod:`trainer.engines`).
ENGINES = EngineRegistry()


def register_engine(name: str, factory: EngineFactory, *, preflight: Callable[[Any], None] | None = None,
                    overwrite: bool = False) -> None:
    """Register an engine in :data:`ENGINES` (see :meth:`EngineRegistry.register`)."""
    ENGINES.register(name, factory, preflight=preflight, overwrite=overwrite)


def make_engine(name: str, spec: EngineSpec) -> EngineHandle:
    """Start engine ``name`` from :data:`ENGINES` (see :meth:`EngineRegistry.make`)."""
    return ENGINES.make(name, spec)
