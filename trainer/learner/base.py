"""The learner seam: what the training loop needs from a learner backend, and nothing more.

A backend (plain torch today; FSDP2 and Megatron-core next) implements :class:`Learner` and
registers a factory under a name; ``learner.backend`` in the config picks it and
:func:`make_learner` builds it from a :class:`~trainer.learner.spec.LearnerSpec` (never the
experiment config). The loop (:mod:`trainer.orchestration.loop`), the Ray launcher
and ``run.py`` use only this protocol. The RL maths a backend reuses lives in
:mod:`trainer.learner.algorithm` (which calls :mod:`copc`).

Adding a backend = one file defining the class + one :func:`register_learner` call. The registry
(:data:`LEARNERS`, :func:`register_learner`) lives in :mod:`trainer.learner.registry`, which
registers the built-ins without importing them (re-exported here).

A backend whose state is sharded over processes (``fsdp``, ``megatron``) also implements
:class:`ShardedCheckpoint`: its ranks write the state into a directory of the checkpoint being
built. ``run.py`` and ``context.py`` go through :func:`learner_checkpoint_state` /
:func:`restore_learner`, which handle both kinds.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import torch

from ..errors import ConfigError
from ..outputs.checkpoint import DirectoryState
from ..rollout.batch import RolloutBatch
from .registry import (  # noqa: F401 - re-exported: the registry and its built-ins are defined without torch
    LEARNER_METADATA,
    LEARNERS,
    register_learner,
)
from .spec import LearnerSpec

#: Checkpoint key of a :class:`ShardedCheckpoint` learner's directory (next to ``learner``).
SHARDED_STATE_KEY = "learner_shards"


@runtime_checkable
class Learner(Protocol):
    """A trainable actor (+ optional critic) behind one interface.

    ``policy_version`` counts updates: the weights after ``n`` calls of :meth:`step` are
    policy version ``n`` (restored by :meth:`load_state_dict`).
    """

    @property
    def policy_version(self) -> int:
        """Policy version of the current weights (number of :meth:`step` calls, resumes included)."""

    def step(self, batch: RolloutBatch) -> dict[str, float]:
        """Train on one batch; return scalar metrics (``actor/…``, ``critic/…``, ``perf/…``).

        The batch's tokens carry the policy versions that produced them; staleness is measured
        against :attr:`policy_version` before the update.
        """

    def export_policy_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The actor's weights as ``(name, tensor)`` in Hugging Face names (``save_pretrained``
        layout), gathered on one process; for engine weight sync and export. A LoRA actor's are
        merged (``W + (alpha / rank) · B A``); its weight syncs use ``export_adapter()`` instead
        (an optional method of backends registered with ``lora=True``:
        :class:`~trainer.models.lora.AdapterWeights`, see :func:`~trainer.models.lora.adapter_of`)."""

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to resume (models, optimizers, schedulers, counters)."""

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` output."""


#: ``factory(spec, model_dir) -> Learner``: ``spec`` is the :class:`~trainer.learner.spec.LearnerSpec`
#: built from the experiment config where the run is assembled (the backend's own settings are
#: ``spec.settings``), ``model_dir`` a ``save_pretrained`` directory with the actor's architecture
#: and initial weights.
LearnerFactory = Callable[[LearnerSpec, Path], Learner]


def make_learner(spec: LearnerSpec, model_dir: str | Path) -> Learner:
    """The learner of ``spec.backend``, initialised from ``model_dir``
    (``spec``: :func:`trainer.config.specs.learner_spec`).

    Raises:
        seams.registry.RegistryError: (a ``KeyError``) unknown backend.
    """
    return LEARNERS.get(spec.backend)(spec, Path(model_dir))


@runtime_checkable
class ShardedCheckpoint(Protocol):
    """A learner whose resumable state lives in a directory written by its ranks (collective).

    ``state_dict()`` then returns only a small description; the checkpoint also gets a
    directory ``learner_shards/`` (:data:`SHARDED_STATE_KEY`) filled by :meth:`save_dir`.
    """

    def save_dir(self, path: Path) -> None:
        """Write the complete resumable state into the (new, empty) directory ``path``."""

    def load_dir(self, path: Path) -> None:
        """Restore the state written by :meth:`save_dir` into ``path``."""


def learner_checkpoint_state(learner: Learner) -> dict[str, Any]:
    """The learner's top-level checkpoint entries: ``{"learner": state_dict()}`` plus, for a
    :class:`ShardedCheckpoint` learner, ``{"learner_shards": DirectoryState(save_dir)}``
    (written inside the atomic checkpoint by :meth:`~trainer.outputs.checkpoint.CheckpointManager.save`)."""
    out: dict[str, Any] = {"learner": learner.state_dict()}
    if isinstance(learner, ShardedCheckpoint):
        out[SHARDED_STATE_KEY] = DirectoryState(learner.save_dir)
    return out


def restore_learner(learner: Learner, state: dict[str, Any]) -> None:
    """Restore a learner from a loaded checkpoint (the inverse of :func:`learner_checkpoint_state`).

    Raises:
        ConfigError: the checkpoint's kind does not match the learner (a sharded learner and a
            checkpoint without ``learner_shards``, or the reverse), naming ``learner.backend``
            (and, for a sharded checkpoint, the ``learner.backend_settings`` that wrote it).
    """
    saved = state["learner"]
    sharded = isinstance(learner, ShardedCheckpoint)
    if not sharded and (SHARDED_STATE_KEY in state or (isinstance(saved, dict) and saved.get("sharded"))):
        info = saved if isinstance(saved, dict) else {}
        wrote = " ".join(f"learner.{'' if k == 'backend' else 'backend_settings.'}{k}={info[k]}"
                         for k in ("backend", "world_size", "tensor_parallel_size", "pipeline_parallel_size")
                         if k in info)
        raise ConfigError(f"learner.backend: the checkpoint holds sharded learner state "
                          f"({SHARDED_STATE_KEY}/) that this {type(learner).__name__} cannot read; resume or "
                          f"evaluate it with the settings that wrote it: "
                          f"{wrote or 'its distributed learner.backend'}")
    learner.load_state_dict(saved)
    if sharded != (SHARDED_STATE_KEY in state):
        raise ConfigError(f"learner.backend: the checkpoint {'lacks' if sharded else 'has'} sharded learner "
                          f"state ({SHARDED_STATE_KEY}/); resume with the learner.backend that wrote it")
    if sharded:
        learner.load_dir(Path(state[SHARDED_STATE_KEY]))
