"""Registry of tool environments: ``register(id, entry_point, **defaults)``, ``make``, ``list``.

Independent of Gymnasium's global registry (so projects can register private envs without
side effects); the built-ins are additionally registered with ``gymnasium.register`` under
``copc/...`` ids (see ``environments/__init__.py``).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import gymnasium


@dataclass(frozen=True)
class EnvSpec:
    """A registered environment: id, ``"pkg.mod:Cls"`` entry point (or callable), defaults."""

    id: str
    entry_point: str | Callable[..., gymnasium.Env]
    defaults: dict[str, Any] = field(default_factory=dict)

    def load(self) -> Callable[..., gymnasium.Env]:
        """Import and return the class/factory.

        Raises:
            ValueError: malformed entry point; ImportError/AttributeError: not importable.
        """
        if callable(self.entry_point):
            return self.entry_point
        mod, sep, attr = self.entry_point.partition(":")
        if not sep or not mod or not attr:
            raise ValueError(f"entry_point={self.entry_point!r} for env {self.id!r}: "
                             "expected 'package.module:ClassName'")
        return getattr(importlib.import_module(mod), attr)


class Registry:
    """A mapping of env ids to :class:`EnvSpec`."""

    def __init__(self) -> None:
        self._specs: dict[str, EnvSpec] = {}

    def register(self, id: str, entry_point: str | Callable[..., gymnasium.Env],
                 overwrite: bool = False, **defaults: Any) -> EnvSpec:
        """Register ``id``; ``defaults`` become constructor kwargs.

        Raises:
            ValueError: empty id, or ``id`` already registered and ``overwrite`` is False.
        """
        if not isinstance(id, str) or not id:
            raise ValueError(f"env id must be a non-empty str, got {id!r}")
        if id in self._specs and not overwrite:
            raise ValueError(f"env id {id!r} is already registered (pass overwrite=True)")
        spec = EnvSpec(id, entry_point, dict(defaults))
        self._specs[id] = spec
        return spec

    def make(self, id: str, **overrides: Any) -> gymnasium.Env:
        """Construct env ``id`` with its defaults updated by ``overrides``.

        Raises:
            KeyError: unknown id (the message lists the registered ids).
        """
        if id not in self._specs:
            raise KeyError(f"unknown env id {id!r}; registered: {sorted(self._specs)}")
        spec = self._specs[id]
        return spec.load()(**{**spec.defaults, **overrides})

    def list(self) -> list[str]:
        """Sorted registered ids."""
        return sorted(self._specs)

    def spec(self, id: str) -> EnvSpec:
        """The :class:`EnvSpec` of ``id`` (KeyError if unknown)."""
        return self._specs[id]


DEFAULT_REGISTRY = Registry()
