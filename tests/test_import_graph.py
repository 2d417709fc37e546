"""scripts/check_imports.py: cycles and back-edges found on small packages written into tmp_path."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "check_imports.py"


def _load():
    spec = importlib.util.spec_from_file_location("check_imports", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["check_imports"] = mod  # dataclasses look their module up by name
    spec.loader.exec_module(mod)
    return mod


ci = _load()


def _write(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


def _run(root: Path, packages: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(SCRIPT), "--root", str(root), "--packages", packages],
        capture_output=True,
        text=True,
        timeout=60,
    )


LAYERS = (("low",), ("high",))


def test_relative_lazy_and_init_imports_become_edges(tmp_path):
    root = _write(
        tmp_path,
        {
            "low/__init__.py": "from .a import f\n",
            "low/a.py": "import os\n\ndef f():\n    from . import b\n    return b\n",
            "low/b.py": "from .sub import c\nfrom low.sub.c import g as _g\n",
            "low/sub/__init__.py": "",
            "low/sub/c.py": "from .. import a\nfrom ..a import f\nimport low.sub\n",
        },
    )
    graph = ci.build_graph(root, ["low"])
    assert sorted(graph.modules) == ["low", "low.a", "low.b", "low.sub", "low.sub.c"]
    edges = {(e.source, e.target) for e in graph.edges}
    assert edges == {
        ("low", "low.a"),  # from .a import f  (in __init__: level 1 is the package itself)
        ("low.a", "low.b"),  # lazy, inside a function
        ("low.b", "low.sub.c"),  # from .sub import c: c is a module, so the arrow points at it
        ("low.sub.c", "low.a"),  # from .. import a  and  from ..a import f
        ("low.sub.c", "low.sub"),  # import low.sub (the package's __init__ is a module)
    }
    lazy = [e for e in graph.edges if e.source == "low.a"]
    assert [(e.path, e.line) for e in lazy] == [("low/a.py", 4)]
    # low.a -> low.b -> low.sub.c -> low.a: one cycle of three; low and low.sub stand outside it.
    assert ci.find_cycles(graph) == [["low.a", "low.b", "low.sub.c"]]


def test_planted_back_edge_is_reported_and_forward_edge_is_not(tmp_path):
    root = _write(
        tmp_path,
        {
            "low/__init__.py": "",
            "low/x.py": "def late():\n    import high.y\n",
            "high/__init__.py": "",
            "high/y.py": "from low import x\n",
        },
    )
    graph = ci.build_graph(root, ["low", "high"])
    back = ci.find_back_edges(graph, LAYERS)
    assert [(e.source, e.target, e.path, e.line) for e in back] == [("low.x", "high.y", "low/x.py", 2)]
    assert ci.find_cycles(graph) == [["high.y", "low.x"]]
    assert ci.report(graph, LAYERS, quiet=True) == 2


def test_clean_package_passes_and_unplaced_module_is_reported(tmp_path, capsys):
    root = _write(
        tmp_path,
        {
            "low/__init__.py": "import json\nfrom .x import A\n",
            "low/x.py": "A = 1\n",
            "high/__init__.py": "from low import A\nimport low.x\n",
        },
    )
    graph = ci.build_graph(root, ["low", "high"])
    assert ci.find_cycles(graph) == []
    assert ci.find_back_edges(graph, LAYERS) == []
    assert ci.report(graph, LAYERS) == 0
    assert "3 modules, 3 import arrows; 0 cycles, 0 back-edges, 0 unplaced modules" in capsys.readouterr().out
    assert ci.unplaced(graph, (("low",),)) == ["high"]
    # "=pkg" names the package's __init__ only, not its sub-modules.
    assert ci.layer_of("low", (("=low",),)) == 0
    assert ci.layer_of("low.x", (("=low",),)) is None
    assert ci.layer_of("low.x", (("low",), ("low.x",))) == 1  # the longest prefix wins


def test_command_line_exit_status_with_the_house_layers(tmp_path):
    # copc sits below retriever (seams below both): copc -> retriever is a back-edge.
    bad = _write(
        tmp_path / "bad",
        {"copc/__init__.py": "from retriever import R\n", "retriever/__init__.py": "R = 1\n"},
    )
    out = _run(bad, "copc,retriever")
    assert out.returncode == 1, out.stdout + out.stderr
    assert "back-edge: copc (layer 1) -> retriever (layer 2)  (copc/__init__.py:1)" in out.stdout
    good = _write(
        tmp_path / "good",
        {"copc/__init__.py": "R = 1\n", "retriever/__init__.py": "from copc import R\n"},
    )
    out = _run(good, "copc,retriever")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "0 cycles, 0 back-edges" in out.stdout


def test_every_module_of_the_house_has_a_layer():
    graph = ci.build_graph(ROOT, ci.PACKAGES)
    assert len(graph.modules) > 100
    assert ci.unplaced(graph) == []


def test_relative_import_above_the_top_package_is_an_error(tmp_path):
    root = _write(tmp_path, {"low/__init__.py": "from ... import x\n"})
    with pytest.raises(SystemExit, match="beyond the top package"):
        ci.build_graph(root, ["low"])
