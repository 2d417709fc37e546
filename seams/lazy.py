"""A package's public names imported on first access (PEP 562), so importing the package stays light.

A package whose public API mixes light names (settings, registries: read when a config is
validated) with names that need torch or transformers re-exports the heavy ones lazily::

    __getattr__, __dir__ = lazy_exports(__name__, {"registry": ("compute_advantages",)})

``package.compute_advantages`` (and ``from package import compute_advantages``) then imports
``package.registry`` on first access; ``import package`` does not. Pure standard library.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any


def lazy_exports(package: str, exports: Mapping[str, Sequence[str]]
                 ) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """The module-level ``__getattr__`` and ``__dir__`` of ``package`` for its lazy names.

    Args:
        package: the package's ``__name__``.
        exports: submodule (relative to ``package``, dotted: ``"backends.torch"``) → the public
            names it defines that ``package`` re-exports.

    Returns:
        ``(__getattr__, __dir__)``: the first imports the submodule of a lazy name on first access
        and keeps the value on the package (later accesses skip it), raising ``AttributeError`` for
        any other name; the second lists the package's names and the lazy ones.
    """
    module_of = {name: module for module, names in exports.items() for name in names}

    def getattr_(name: str) -> Any:
        module = module_of.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(f".{module}", package), name)
        setattr(sys.modules[package], name, value)
        return value

    def dir_() -> list[str]:
        return sorted(set(vars(sys.modules[package])) | set(module_of))

    return getattr_, dir_
