"""Registry of tool environments: ``register(id, entry_point, **defaults)``, ``make``, ``names``,
``resolve``.

Independent of Gymnasium's global registry (so projects can register private envs without
side effects); the built-ins are additionally registered with ``gymnasium.register`` under
``copc/...`` ids (see ``environments/__init__.py``).

An environment defined outside this package is named in a config as ``"<module>:<id>"`` (like
``gymnasium.make("module:Env-v0")``): :meth:`Registry.resolve` imports the module (a dotted
module name, or a ``.py`` file path relative to the current working directory), whose import
registers ``<id>``.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import inspect
import sys
import typing
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import gymnasium

from seams.registry import Registry as CoreRegistry
from seams.registry import RegistryError


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

    def parameters(self) -> list[str] | None:
        """The settings the entry point declares, sorted: its named parameters and, when it takes
        ``**overrides`` beside a dataclass ``config`` parameter (the built-in environments), that
        dataclass's fields. None when it takes any ``**kwargs`` otherwise, or its signature cannot
        be read (nothing to check a setting's name against).

        Raises:
            ValueError, ImportError, AttributeError: see :meth:`load`.
        """
        fn = self.load()
        try:
            params = inspect.signature(fn).parameters
        except (TypeError, ValueError):
            return None
        named = {n for n, p in params.items()
                 if p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)}
        if all(p.kind is not inspect.Parameter.VAR_KEYWORD for p in params.values()):
            return sorted(named)
        try:
            hints = typing.get_type_hints(fn.__init__ if isinstance(fn, type) else fn)
        except Exception:  # an annotation that does not resolve: no declared settings to offer
            return None
        config = hints.get("config")
        for t in (*typing.get_args(config), config):
            if isinstance(t, type) and dataclasses.is_dataclass(t):
                return sorted((named - {"config"}) | {f.name for f in dataclasses.fields(t)})
        return None


class Registry:
    """A mapping of env ids to :class:`EnvSpec` (Gymnasium-style ``register`` / ``make``), kept
    in a :class:`seams.registry.Registry` (the one registry class of the house; errors are its
    :class:`~seams.registry.RegistryError`, both a ``KeyError`` and a ``ValueError``).

    Attributes:
        table: the underlying :class:`seams.registry.Registry` of :class:`EnvSpec` entries.
    """

    def __init__(self) -> None:
        self.table: CoreRegistry[EnvSpec] = CoreRegistry("env id", key="task.env", callable_entries=False)

    def register(self, id: str, entry_point: str | Callable[..., gymnasium.Env],
                 overwrite: bool = False, **defaults: Any) -> EnvSpec:
        """Register ``id``; ``defaults`` become constructor kwargs.

        Raises:
            RegistryError: (a ``ValueError``) empty id, or ``id`` already registered and
                ``overwrite`` is False.
        """
        if not isinstance(id, str) or not id:
            raise RegistryError(f"env id must be a non-empty str, got {id!r}")
        return self.table.register(id, EnvSpec(id, entry_point, dict(defaults)), overwrite=overwrite)

    def unregister(self, id: str) -> EnvSpec:
        """Remove ``id`` (e.g. a test's temporary environment) and return its spec.

        Raises:
            RegistryError: unknown id.
        """
        self.spec(id)
        return self.table.unregister(id)

    def make(self, id: str, **overrides: Any) -> gymnasium.Env:
        """Construct env ``id`` with its defaults updated by ``overrides``.

        Raises:
            RegistryError: (a ``KeyError``) unknown id (the message lists the registered ids).
        """
        spec = self.spec(id)
        return spec.load()(**{**spec.defaults, **overrides})

    def names(self) -> list[str]:
        """The registered ids, sorted."""
        return self.table.names()

    def spec(self, id: str) -> EnvSpec:
        """The :class:`EnvSpec` of ``id``.

        Raises:
            RegistryError: (a ``KeyError``) unknown id (the message lists the registered ids).
        """
        if id not in self.table:
            raise RegistryError(f"unknown env id {id!r}; registered: {self.names()}")
        return self.table.get(id)

    def __contains__(self, id: object) -> bool:
        return id in self.table

    def resolve(self, ref: str) -> str:
        """The registered id that ``ref`` names, importing the module that registers it first.

        Args:
            ref: a registered id (``"calc"``); ``"pkg.module:calc"`` (imports ``pkg.module``,
                whose import registers ``calc``); or ``"path/to/calc_env.py:calc"`` (executes
                that file once per process as module ``calc_env``; a relative path is taken
                from the current working directory).

        Returns:
            The id (the part after the last ``:``).

        Raises:
            ValueError: empty id or module part, or a ``.py`` file whose module name is already
                taken by another module.
            FileNotFoundError: the ``.py`` file does not exist.
            ImportError: the module cannot be imported (its own errors propagate too).
            RegistryError: (a ``KeyError``) the id is not registered (after the import); the
                message lists the ids.
        """
        module, sep, id = ref.rpartition(":")
        if not id or (sep and not module):
            raise ValueError(f"env reference {ref!r}: expected 'id', 'package.module:id' or 'file.py:id'")
        if module:
            import_env_module(module)
        if id not in self.table:
            where = f" after importing {module!r}" if module else ""
            raise RegistryError(f"unknown env id {id!r}{where}; registered: {self.names()}")
        return id


def import_env_module(module: str) -> Any:
    """Import ``module``: a dotted module name, or a ``.py`` file (relative to the current
    working directory unless absolute) loaded once per process under its file stem, with its
    directory put on ``sys.path`` (so it can import the modules next to it).

    Returns:
        The module.

    Raises:
        FileNotFoundError: the ``.py`` file does not exist.
        ValueError: the stem names another, already imported module.
        ImportError: not importable.
    """
    if not module.endswith(".py"):
        return importlib.import_module(module)
    path = Path(module).expanduser().resolve()
    if not path.is_file():
        raise FileNotFoundError(f"environment module file {module!r} not found (looked at {path})")
    name = path.stem
    loaded = sys.modules.get(name)
    if loaded is not None:
        if getattr(loaded, "__file__", None) and Path(loaded.__file__).resolve() == path:
            return loaded
        raise ValueError(f"environment module file {module!r}: a different module named {name!r} "
                         f"is already imported ({getattr(loaded, '__file__', None)}); rename the file")
    if str(path.parent) not in sys.path:  # so the file can import its sibling modules
        sys.path.insert(0, str(path.parent))
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot import {module!r} as a module")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod  # classes defined there pickle by module name
    try:
        spec.loader.exec_module(mod)
    except BaseException:
        sys.modules.pop(name, None)
        raise
    return mod


DEFAULT_REGISTRY = Registry()
# MCP server tools (needs the mcp extra).
DEFAULT_REGISTRY.register("mcp", "environments.mcp_tool.env:McpToolEnv")

# ``remote``: an environment served by an OpenEnv server (``task.env: remote``, ``task.env_kwargs.url``).
DEFAULT_REGISTRY.register("remote", "environments.remote.client:RemoteEnv")
