"""No module branches on the name of a built-in plug-in outside that plug-in's own file.

Read with :mod:`ast` (nothing executed): every comparison (``==``, ``!=``, ``in``, ``not in``)
of a *plug-in reference* — an expression whose last name is one of :data:`SEAM_NAMES`
(``cfg.rollout.engine``, ``spec.kind``, ``env_id``, ``summary.get("kind")``, ...) — against a
string constant (or a tuple/list/set of them) that is the name of a registered built-in
plug-in. Such a branch is allowed only in a file where one of the plug-ins of that name is
defined (its entry's source file). Capabilities are read from the registries' metadata instead
(``docs/seams.md``).
"""

from __future__ import annotations

import ast
import importlib
import inspect
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("seams", "copc", "environments", "retriever", "trainer")

#: Last names of expressions that hold a plug-in's name (the config keys of the seams and their
#: usual local spellings).
SEAM_NAMES = frozenset({"engine", "backend", "advantage_estimator", "policy_loss", "estimator", "loss",
                        "env", "env_id", "kind", "launcher", "service", "task"})

#: ``(registry module, attribute)`` of every registry whose built-in names are checked; a
#: registry that is not on this tree yet is skipped.
REGISTRIES = (
    ("copc.registries", "ADVANTAGE_ESTIMATORS"), ("copc.registries", "POLICY_LOSSES"),
    ("trainer.engines.registry", "ENGINES"), ("trainer.learner.base", "LEARNERS"),
    ("trainer.learner.distributed.registry", "RANK_LEARNERS"), ("trainer.tasks", "TASKS"),
    ("trainer.evaluate.kinds", "BENCHMARK_KINDS"), ("trainer.orchestration.launchers", "LAUNCHERS"),
)

#: Branches still to be replaced by the seam that owns them, ``(file, name) -> why``. Shrink it;
#: never add to it (a new branch reads the plug-in's metadata instead).
PENDING: dict[tuple[str, str], str] = {
    ("trainer/evaluate/report.py", "qa"): "summary kind: the benchmark-kind registry (issue 20, 'eval')",
}


def _source_file(obj: object) -> str | None:
    """The repository-relative source file defining ``obj`` (a function, class, bound method,
    or an environment spec's ``"module:Class"`` entry point), or None."""
    entry = getattr(obj, "entry_point", obj)
    if isinstance(entry, str):
        module = entry.partition(":")[0]
        spec = importlib.util.find_spec(module)
        path = spec.origin if spec else None
    else:
        try:
            path = inspect.getsourcefile(inspect.unwrap(getattr(entry, "__func__", entry)))
        except TypeError:
            path = None
    if path is None:
        return None
    try:
        return Path(path).resolve().relative_to(ROOT).as_posix()
    except ValueError:
        return None


def builtin_names() -> dict[str, set[str]]:
    """Each built-in plug-in name → the files where a plug-in of that name is defined."""
    import environments

    own: dict[str, set[str]] = {}
    for module, attr in REGISTRIES:
        try:
            reg = getattr(importlib.import_module(module), attr)
        except (ImportError, AttributeError):
            continue
        for name in reg.names():
            own.setdefault(name, set()).add(_source_file(reg.get(name)) or "")
    for name in environments.names():
        own.setdefault(name, set()).add(_source_file(environments.DEFAULT_REGISTRY.spec(name)) or "")
    return own


def _ref_name(node: ast.expr) -> str | None:
    """The last name of a plug-in reference (``a.b.engine`` → ``engine``, ``d.get("kind")`` →
    ``kind``, ``getattr(x, "kind", ...)`` → ``kind``), or None."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    if isinstance(node, ast.Call):
        func, key = node.func, None
        if isinstance(func, ast.Attribute) and func.attr == "get" and node.args:
            key = node.args[0]
        elif isinstance(func, ast.Name) and func.id == "getattr" and len(node.args) > 1:
            key = node.args[1]
        if isinstance(key, ast.Constant) and isinstance(key.value, str):
            return key.value
    return None


def _strings(node: ast.expr) -> list[str]:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node.value]
    if isinstance(node, ast.Tuple | ast.List | ast.Set):
        return [e.value for e in node.elts if isinstance(e, ast.Constant) and isinstance(e.value, str)]
    return []


def name_branches(source: str, names: set[str]) -> list[tuple[int, str, str]]:
    """``(line, name, code)`` of each comparison of a plug-in reference against one of ``names``."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Compare):
            continue
        operands = [node.left, *node.comparators]
        if not any(_ref_name(o) in SEAM_NAMES for o in operands):
            continue
        for o in operands:
            out += [(node.lineno, s, ast.unparse(node)) for s in _strings(o) if s in names]
    return out


def test_the_scanner_finds_what_it_must():
    names = {"sglang", "qa", "ray"}
    src = ("if cfg.rollout.engine == 'sglang': pass\n"
           "ok = spec.kind in ('qa', 'math')\n"
           "if summary.get('kind') != 'qa': pass\n"
           "if getattr(c.launcher, 'kind', 'local') == 'ray': pass\n"
           "if cfg.learner.launch == 'ray': pass\n"      # not a plug-in reference
           "if name == 'sglang': pass\n")                 # a bare 'name' is not one either
    assert [(line, n) for line, n, _ in name_branches(src, names)] == [(1, "sglang"), (2, "qa"), (3, "qa"),
                                                                      (4, "ray")]


def test_builtin_names_cover_every_kind():
    own = builtin_names()
    for name in ("copc", "grpo", "dis", "embedded", "sglang", "torch", "fsdp", "search", "math_tool", "qa"):
        assert name in own, name
    assert "trainer/engines/builtin.py" in own["sglang"]


@pytest.mark.parametrize("package", PACKAGES)
def test_no_module_branches_on_a_builtin_plugin_name(package):
    own = builtin_names()
    bad = []
    for path in sorted((ROOT / package).rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        for line, name, code in name_branches(path.read_text(), set(own)):
            if rel in own[name] or (rel, name) in PENDING:
                continue
            bad.append(f"{rel}:{line}: {code}  (read the plug-in's metadata instead of its name {name!r})")
    assert not bad, "\n".join(bad)
