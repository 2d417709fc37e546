"""Multi-turn text tool environments (Gymnasium), a registry, and the Python sandbox.

``environments.make("math_tool")`` / ``gymnasium.make("copc/MathTool-v0")``;
``environments.register(id, entry_point="pkg.mod:Cls", **defaults)``; ``environments.names()``;
``environments.resolve("my_pkg.envs:calc")`` (import the module that registers an id).
"""

from __future__ import annotations

from typing import Any

import gymnasium

from .base import EnvLimits, RegexTool, TextSpace, Tool, ToolCall, ToolEnv, truncate_observation
from .errors import InfrastructureError
from .registry import DEFAULT_REGISTRY, EnvSpec, Registry

__all__ = ["DEFAULT_REGISTRY", "EnvLimits", "EnvSpec", "InfrastructureError", "RegexTool", "Registry",
           "TextSpace", "Tool", "ToolCall", "ToolEnv", "make", "names", "register", "resolve",
           "truncate_observation", "unregister"]


def register(id: str, entry_point: Any, overwrite: bool = False, **defaults: Any) -> EnvSpec:
    """Register an environment in the default registry.

    Args:
        id: the environment id (what ``task.env`` names).
        entry_point: ``"package.module:ClassName"`` or a callable returning a ``gymnasium.Env``.
        overwrite: replace an existing registration of ``id``.
        **defaults: constructor keyword arguments (overridden by :func:`make`'s).

    Returns:
        The :class:`EnvSpec`.

    Raises:
        seams.registry.RegistryError: (a ``ValueError``) empty id, or ``id`` already
            registered and ``overwrite`` is False.
    """
    return DEFAULT_REGISTRY.register(id, entry_point, overwrite=overwrite, **defaults)


def make(id: str, **overrides: Any) -> gymnasium.Env:
    """Build a registered environment of the default registry.

    Args:
        id: a registered id.
        **overrides: constructor keyword arguments, on top of the registered defaults.

    Returns:
        A new environment.

    Raises:
        seams.registry.RegistryError: (a ``KeyError``) unknown id (the message lists the
            registered ids); the constructor's own
            errors (``TypeError``, ``ValueError``, ...) propagate.
    """
    return DEFAULT_REGISTRY.make(id, **overrides)


def unregister(id: str) -> None:
    """Forget environment ``id`` of the default registry (no error if it is not registered;
    e.g. a test's temporary environment)."""
    if id in DEFAULT_REGISTRY:
        DEFAULT_REGISTRY.unregister(id)


def names() -> list[str]:
    """The ids registered in the default registry, sorted."""
    return DEFAULT_REGISTRY.names()


def resolve(ref: str) -> str:
    """The registered id named by ``ref`` (``"calc"``, ``"my_pkg.envs:calc"`` or
    ``"calc_env.py:calc"``), importing its module first; see :meth:`Registry.resolve`.

    Raises:
        ValueError, FileNotFoundError, ImportError, KeyError: see :meth:`Registry.resolve`.
    """
    return DEFAULT_REGISTRY.resolve(ref)


_BUILTINS = {
    "math_tool": ("copc/MathTool-v0", "environments.math_tool.env:MathToolEnv"),
    "search": ("copc/Search-v0", "environments.search.env:SearchEnv"),
}
for _short, (_gym_id, _entry) in _BUILTINS.items():
    DEFAULT_REGISTRY.register(_short, _entry)
    if _gym_id not in gymnasium.registry:
        gymnasium.register(id=_gym_id, entry_point=_entry)
