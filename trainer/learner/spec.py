"""What a learner backend gets instead of the experiment config: :class:`LearnerSpec`.

The spec is built once where the run is assembled (:func:`trainer.config.specs.learner_spec`
reads the config's ``learner``, ``train``, ``model``, ``rollout``, ``logging`` and ``plugins``);
nothing in :mod:`trainer.learner` reads the experiment config. A backend's factory gets
``factory(spec, model_dir)``, a distributed backend's rank learner ``factory(spec, model_dir, ctx)``
in each rank process, which receives the pickled spec.
"""

from __future__ import annotations

import pickle
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any, TypeVar

import copc

from ..errors import ConfigError
from ..plugins import import_plugins, registry
from .allocator import DEFAULT_MMAP_THRESHOLD
from .settings import LearnerConfig

S = TypeVar("S")


@dataclass(frozen=True)
class LearnerSpec:
    """The typed spec of a learner backend (frozen, picklable: it travels to rank processes and Ray
    actors; unpickling imports :attr:`plugins` first, so a settings class or an algorithm plug-in
    defined in one resolves there).

    Attributes:
        backend: the backend's registered name (``learner.backend``).
        algorithm: the validated :class:`copc.AlgorithmConfig` (preset + ``algorithm`` overrides).
        step: the step settings (:class:`~trainer.learner.settings.LearnerConfig`: optimiser,
            mini-batches, temperature, seed, LoRA, ...), built with the backend's :attr:`settings`.
        settings: the backend's own settings (``learner.backend_settings`` as the dataclass it was
            registered with, e.g. :class:`~trainer.learner.backend_settings.TorchSettings`), or None
            for a backend registered without settings.
        raw_settings: ``learner.backend_settings`` as a plain mapping (:meth:`settings_as` reads it
            as another backend's settings class).
        dtype: the parameters' dtype, ``float32`` | ``bfloat16`` | ``float16`` (``model.dtype``).
        attn_implementation: ``eager`` | ``sdpa`` | ``flash_attention_2`` (``model.attn_implementation``).
        plugins: the run's plug-ins (``plugins``), ``.py`` paths absolute (rank processes and Ray
            actors may run in another working directory).
        torch_threads: torch intra-op threads of a rank process (``train.torch_threads``; 0: the
            machine's cores split between its ranks).
        malloc_mmap_threshold: a learner process's malloc mmap threshold in bytes
            (``learner.malloc_mmap_threshold``; 0: glibc's default).
        malloc_trim: a learner process returns its free C heap to the OS after every step
            (``learner.malloc_trim``).
        keep_step_inputs: the run keeps per-step samples (``logging.samples_per_step > 0``), so a
            distributed learner brings rank 0's per-token step inputs back after each step.
    """

    backend: str
    algorithm: copc.AlgorithmConfig
    step: LearnerConfig = field(default_factory=LearnerConfig)
    settings: Any = None
    raw_settings: Mapping[str, Any] = field(default_factory=dict)
    dtype: str = "float32"
    attn_implementation: str = "eager"
    plugins: tuple[str, ...] = ()
    torch_threads: int = 0
    malloc_mmap_threshold: int = DEFAULT_MMAP_THRESHOLD
    malloc_trim: bool = True
    keep_step_inputs: bool = True

    def settings_as(self, cls: type[S]) -> S:
        """The backend's settings as a ``cls`` instance.

        Returns:
            :attr:`settings` when it is a ``cls``; otherwise (a backend registered without settings
            or with another type, e.g. a rank learner's factory called directly with a ``torch``
            spec) :attr:`raw_settings` built as a ``cls`` by the learner registry, as for the backend
            registered with ``cls`` (empty: its defaults).

        Raises:
            ConfigError: no backend registered with ``cls``, or a setting ``cls`` does not have, a
                wrong type or value (one line naming ``learner.backend_settings.<key>``).
        """
        if isinstance(self.settings, cls):
            return self.settings
        learners = registry("learner.backend")  # trainer.learner.registry.LEARNERS
        # read the section as the backend registered with ``cls`` would (same checks, same messages)
        owner = next((n for n in learners.names() if learners.settings_type(n) is cls), None)
        if owner is None:
            raise ConfigError(f"learner.backend={self.backend!r}: its settings are not a {cls.__name__} "
                              f"and no learner backend is registered with {cls.__name__}")
        try:
            return learners.build_settings(owner, dict(self.raw_settings), "learner.backend_settings")
        except ValueError as e:  # the registry's one-line error (RegistryError is a ValueError)
            raise ConfigError(str(e)) from None

    def step_with(self, settings: Any) -> LearnerConfig:
        """:attr:`step` with the step fields of ``settings`` (a backend's settings read through
        :meth:`settings_as`): :attr:`step` itself when ``settings`` is :attr:`settings`, else its
        :data:`~trainer.learner.settings.STEP_FIELDS` taken from ``settings`` (defaults for those
        it lacks)."""
        return self.step if settings is self.settings else self.step.with_backend(settings)

    def __reduce__(self) -> tuple[Any, tuple[tuple[str, ...], bytes]]:
        """Pickle as ``(plugins, fields)``: :func:`restore_spec` imports the plug-ins before
        unpickling the fields, which may be instances of their classes."""
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        return restore_spec, (tuple(self.plugins), pickle.dumps(values, protocol=pickle.HIGHEST_PROTOCOL))


def restore_spec(plugins: tuple[str, ...], values: bytes) -> LearnerSpec:
    """Unpickle a :class:`LearnerSpec` (its ``__reduce__``): import ``plugins``, then the fields.

    Raises:
        ConfigError: a plug-in cannot be imported (:func:`trainer.plugins.import_plugins`).
    """
    import_plugins(plugins)
    return LearnerSpec(**pickle.loads(values))


__all__ = ["LearnerSpec", "restore_spec"]
