"""Fixtures of the sweep tests: the report scripts of ``scripts/`` loaded as modules."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

import pytest

SCRIPTS = Path(__file__).resolve().parents[3] / "scripts"


def _load(name: str) -> ModuleType:
    """``scripts/<name>.py`` as a module (the scripts are not a package)."""
    spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def report() -> ModuleType:
    """``scripts/critic_arms_report.py``."""
    return _load("critic_arms_report")


@pytest.fixture(scope="module")
def grid() -> ModuleType:
    """``scripts/eta_grid_report.py``."""
    return _load("eta_grid_report")
