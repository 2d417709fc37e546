"""README's "What is here" table is the real tree: one row per package and sub-package (and per
trainer root module), each with the layer scripts/check_imports.py gives it."""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _check_imports():
    spec = importlib.util.spec_from_file_location("check_imports", ROOT / "scripts" / "check_imports.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["check_imports"] = mod
    spec.loader.exec_module(mod)
    return mod


def _table() -> dict[str, int]:
    """Module name -> layer, for every path named in the table's package column."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    section = text.split("## What is here\n", 1)[1].split("\n## ", 1)[0]
    rows: dict[str, int] = {}
    for line in section.splitlines():
        m = re.match(r"\| (\d+) \| (.+?) \| .+ \|$", line)
        if not m:
            continue
        layer, names = int(m.group(1)), re.findall(r"`([^`]+)`", m.group(2))
        base = names[0].rpartition("/")[0] if names[0].endswith(".py") else ""
        for name in names:
            path = name if "/" in name or not base else f"{base}/{name}"
            module = path.removesuffix("/").removesuffix(".py").replace("/", ".")
            assert module not in rows, f"{path} has two rows"
            rows[module] = layer
    return rows


def test_every_package_and_trainer_root_module_has_one_row_with_its_layer():
    ci = _check_imports()
    expected = set()
    for pkg in ci.PACKAGES:
        for init in (ROOT / pkg).rglob("__init__.py"):
            if "__pycache__" not in init.parts:
                expected.add(".".join(init.parent.relative_to(ROOT).parts))
    expected |= {f"trainer.{f.stem}" for f in (ROOT / "trainer").glob("*.py") if f.name != "__init__.py"}
    expected.discard("trainer")  # the table's rows are the trainer's parts
    rows = _table()
    assert sorted(expected - set(rows)) == [], "packages / modules missing from README's table"
    assert sorted(set(rows) - expected) == [], "README's table names packages / modules that do not exist"
    wrong = {m: (layer, ci.layer_of(m)) for m, layer in rows.items() if ci.layer_of(m) != layer}
    assert wrong == {}, "README layer != scripts/check_imports.py layer (README, script)"
    layers = list(rows.values())
    assert layers == sorted(layers), "README's table is not in layer order"
