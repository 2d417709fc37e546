"""Multi-turn text tool environments (Gymnasium), a registry, and the Python sandbox.

``environments.make("math_tool")`` / ``gymnasium.make("copc/MathTool-v0")``;
``environments.register(id, entry_point="pkg.mod:Cls", **defaults)``; ``environments.list()``.
"""

from __future__ import annotations

from typing import Any

import gymnasium

from .base import EnvLimits, RegexTool, TextSpace, Tool, ToolCall, ToolEnv, truncate_observation
from .errors import InfrastructureError
from .registry import DEFAULT_REGISTRY, EnvSpec, Registry

__all__ = ["DEFAULT_REGISTRY", "EnvLimits", "EnvSpec", "InfrastructureError", "RegexTool", "Registry",
           "TextSpace", "Tool", "ToolCall", "ToolEnv", "list", "make", "register", "truncate_observation"]


def register(id: str, entry_point: Any, overwrite: bool = False, **defaults: Any) -> EnvSpec:
    """Register an environment in the default registry (see :meth:`Registry.register`)."""
    return DEFAULT_REGISTRY.register(id, entry_point, overwrite=overwrite, **defaults)


def make(id: str, **overrides: Any) -> gymnasium.Env:
    """Build a registered environment (see :meth:`Registry.make`)."""
    return DEFAULT_REGISTRY.make(id, **overrides)


def list() -> list[str]:
    """Ids registered in the default registry."""
    return DEFAULT_REGISTRY.list()


_BUILTINS = {
    "math_tool": ("copc/MathTool-v0", "environments.math_tool.env:MathToolEnv"),
    "search": ("copc/Search-v0", "environments.search.env:SearchEnv"),
}
for _short, (_gym_id, _entry) in _BUILTINS.items():
    DEFAULT_REGISTRY.register(_short, _entry)
    if _gym_id not in gymnasium.registry:
        gymnasium.register(id=_gym_id, entry_point=_entry)
