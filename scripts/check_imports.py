#!/usr/bin/env python3
"""Import-graph check for the package code: no import cycles, no import from a lower layer to a higher one.

Reads every ``.py`` file under the packages in :data:`PACKAGES` with the stdlib :mod:`ast` (nothing is
imported or executed), collects every static ``import`` / ``from ... import`` statement -- also those
inside functions, ``try`` blocks and ``if TYPE_CHECKING:`` blocks, since a lazy import is still an
arrow in the design -- and resolves relative imports against the importing module. A package's
``__init__.py`` is a module of its own (named after the package).

An edge ``a -> b`` means module ``a`` names module ``b`` in an import statement:
``import x.y`` and ``from x import y`` (``y`` a submodule) point at ``x.y``; ``from x import name``
(``name`` not a submodule) points at ``x`` (its ``__init__``). The implicit import of parent packages
that Python performs is not counted (it would make every sub-package a cycle with its ``__init__``).

Layer order, lowest first (:data:`LAYERS`; the README's "What is here" table is written in the same
order, one row per package with its layer number, checked by ``tests/test_readme_tree.py``). A
module may import modules of its own layer or of any lower layer, never a higher one. A module is
placed in the layer of the longest prefix in the list that names it (a prefix written ``=name``
names that one module only, not its sub-modules); a module of a package in :data:`PACKAGES` that
no prefix names is reported too, so the list stays complete.

  0  seams                 the plug-in machinery: the one registry class, its error, building a
                           plug-in's settings dataclass; pure standard library, imports nothing
  1  copc                  the algorithm: pure tensor code; imports only ``seams`` (its two registries)
  2  retriever             the retrieval server and client; imports nothing of the house
  3  environments          Gymnasium tool environments; the search environment and the remote
                           launcher use ``retriever`` (client, server launch), so it sits above it
  4  trainer.errors, trainer.logprobs, trainer.parent_watch, trainer.plugins, trainer.ray_util
                           leaves: error types, log-prob arithmetic, importing plug-in modules,
                           connecting to Ray
  5  trainer.outputs       what a run writes: checkpoints, metric logs, plots, reports, progress
  6  trainer.models        tiny / Hugging Face models, tokenizers, export
  7  trainer.engines       generation engines (embedded, SGLang) and their registry
  8  trainer.rollout       trajectories, the agent loop over an engine and an environment
  9  trainer.learner       learners (torch / FSDP / Megatron) and the algorithm step;
     trainer.harness       the OpenAI-compatible rollout endpoint for user agents
  10 trainer.config        the typed config schema; it checks names against the engine and learner
                           registries below it, and nothing below it reads a config object
  11 trainer.warmstart     task-agnostic warm start (SFT, trace cache, trace playing)
  12 trainer.tasks         tasks: data, environment, reward, held-out set, services
  13 trainer.evaluate      the evaluation core and benchmark runs
  14 trainer.orchestration the training loop, staleness, the Ray launcher
  15 trainer.app, trainer.sweep
                           assembling and running a job from a config (context, run phases, the
                           train / eval / analyze commands); sweeps of runs
  16 trainer.cli, trainer  the ``copc`` command line, a registry of lazily imported groups
                           (``trainer/__init__`` imports nothing)

Usage: ``python scripts/check_imports.py [--root DIR] [--packages a,b,...] [--quiet]``.
Exit status 0 when the graph is clean, 1 when it has a cycle, a back-edge or an unplaced module.
"""

from __future__ import annotations

import argparse
import ast
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

#: The top-level packages whose code is checked.
PACKAGES: tuple[str, ...] = ("seams", "copc", "retriever", "environments", "trainer")

#: Layers, lowest first; each is the module prefixes it holds (see the module docstring).
LAYERS: tuple[tuple[str, ...], ...] = (
    ("seams",),
    ("copc",),
    ("retriever",),
    ("environments",),
    ("trainer.errors", "trainer.logprobs", "trainer.parent_watch", "trainer.plugins", "trainer.ray_util"),
    ("trainer.outputs",),
    ("trainer.models",),
    ("trainer.engines",),
    ("trainer.rollout",),
    ("trainer.learner", "trainer.harness"),
    ("trainer.config",),
    ("trainer.warmstart",),
    ("trainer.tasks",),
    ("trainer.evaluate",),
    ("trainer.orchestration",),
    ("trainer.app", "trainer.sweep"),
    ("trainer.cli", "=trainer"),
)


@dataclass(frozen=True)
class Edge:
    """One import statement's arrow: ``source`` imports ``target`` at ``path:line``."""

    source: str
    target: str
    path: str
    line: int


@dataclass
class Graph:
    """The import graph: ``modules`` maps a dotted module name to its file; ``edges`` every arrow."""

    modules: dict[str, Path] = field(default_factory=dict)
    edges: list[Edge] = field(default_factory=list)


def module_name(path: Path, root: Path) -> str:
    """Dotted name of the module in ``path`` (``a/b/__init__.py`` -> ``a.b``, ``a/b/c.py`` -> ``a.b.c``)."""
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def find_modules(root: Path, packages: Iterable[str]) -> dict[str, Path]:
    """Every module of ``packages`` under ``root``: dotted name -> file (``__pycache__`` skipped)."""
    modules: dict[str, Path] = {}
    for package in packages:
        base = root / package
        if not (base / "__init__.py").is_file():
            raise SystemExit(f"check_imports: {base} is not a package (no __init__.py)")
        for path in sorted(base.rglob("*.py")):
            if "__pycache__" not in path.parts:
                modules[module_name(path, root)] = path
    return modules


def _resolve_from(node: ast.ImportFrom, name: str, is_package: bool) -> str:
    """Absolute module named by a ``from`` statement in module ``name`` (relative levels resolved)."""
    if node.level == 0:
        return node.module or ""
    base = name.split(".") if is_package else name.split(".")[:-1]
    up = node.level - 1
    if up > len(base) - 1:
        where = f"{name}, line {node.lineno}"
        raise SystemExit(f"check_imports: relative import beyond the top package in {where}")
    base = base[: len(base) - up] if up else base
    return ".".join(base + ([node.module] if node.module else []))


def _targets(node: ast.AST, name: str, is_package: bool, modules: dict[str, Path]) -> list[str]:
    """Internal modules an import statement points at (empty for third-party / stdlib imports)."""
    found: list[str] = []
    if isinstance(node, ast.Import):
        for alias in node.names:
            found.append(alias.name)
    elif isinstance(node, ast.ImportFrom):
        base = _resolve_from(node, name, is_package)
        for alias in node.names:
            sub = f"{base}.{alias.name}" if base else alias.name
            found.append(sub if sub in modules else base)
    internal: list[str] = []
    for target in found:
        # ``import a.b.c`` where only ``a.b`` is ours (c a name), or a typo'd path: nearest known module.
        while target and target not in modules:
            target = target.rpartition(".")[0]
        if target and target not in internal:
            internal.append(target)
    return internal


def build_graph(root: Path, packages: Iterable[str] = PACKAGES) -> Graph:
    """Parse every module of ``packages`` under ``root`` and collect its internal import edges."""
    graph = Graph(modules=find_modules(root, packages))
    for name, path in graph.modules.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        is_package = path.name == "__init__.py"
        for node in ast.walk(tree):
            if not isinstance(node, (ast.Import, ast.ImportFrom)):
                continue
            for target in _targets(node, name, is_package, graph.modules):
                if target != name:
                    rel = path.relative_to(root).as_posix()
                    graph.edges.append(Edge(name, target, rel, node.lineno))
    return graph


def find_cycles(graph: Graph) -> list[list[str]]:
    """The graph's cycles: each strongly connected component with more than one module (Tarjan).

    Returns each component as a sorted list of module names; components sorted by their first name.
    """
    succ: dict[str, set[str]] = {m: set() for m in graph.modules}
    for e in graph.edges:
        succ[e.source].add(e.target)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []
    counter = 0
    for start in sorted(succ):
        if start in index:
            continue
        # Iterative Tarjan: (node, iterator over its successors).
        work = [(start, iter(sorted(succ[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, it = work[-1]
            nxt = next(it, None)
            if nxt is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    comp = []
                    while True:
                        m = stack.pop()
                        on_stack.discard(m)
                        comp.append(m)
                        if m == node:
                            break
                    if len(comp) > 1:
                        components.append(sorted(comp))
            elif nxt not in index:
                index[nxt] = low[nxt] = counter
                counter += 1
                stack.append(nxt)
                on_stack.add(nxt)
                work.append((nxt, iter(sorted(succ[nxt]))))
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
    return sorted(components)


def layer_of(module: str, layers: Sequence[Sequence[str]] = LAYERS) -> int | None:
    """Layer index of the longest prefix naming ``module`` (``None``: none does; ``=x`` names ``x`` only)."""
    best: tuple[int, int] | None = None  # (prefix length, layer)
    for rank, prefixes in enumerate(layers):
        for prefix in prefixes:
            if prefix.startswith("="):
                hit = module == prefix[1:]
            else:
                hit = module == prefix or module.startswith(prefix + ".")
            if hit and (best is None or len(prefix) > best[0]):
                best = (len(prefix), rank)
    return None if best is None else best[1]


def find_back_edges(graph: Graph, layers: Sequence[Sequence[str]] = LAYERS) -> list[Edge]:
    """Edges from a module of a lower layer to a module of a higher layer (unplaced modules skipped)."""
    out = []
    for e in graph.edges:
        a, b = layer_of(e.source, layers), layer_of(e.target, layers)
        if a is not None and b is not None and a < b:
            out.append(e)
    return out


def unplaced(graph: Graph, layers: Sequence[Sequence[str]] = LAYERS) -> list[str]:
    """Modules that no layer prefix names."""
    return sorted(m for m in graph.modules if layer_of(m, layers) is None)


def cycle_edges(graph: Graph, component: list[str]) -> list[Edge]:
    """The edges inside one cycle component, sorted, to show where each arrow is written."""
    members = set(component)
    return sorted(
        (e for e in graph.edges if e.source in members and e.target in members),
        key=lambda e: (e.source, e.target, e.line),
    )


def report(graph: Graph, layers: Sequence[Sequence[str]] = LAYERS, quiet: bool = False) -> int:
    """Print every cycle, back-edge and unplaced module; return the number of problems found."""
    cycles = find_cycles(graph)
    back = find_back_edges(graph, layers)
    loose = unplaced(graph, layers)
    for comp in cycles:
        print(f"cycle ({len(comp)} modules): {', '.join(comp)}")
        for e in cycle_edges(graph, comp):
            print(f"    {e.source} -> {e.target}  ({e.path}:{e.line})")
    for e in back:
        la, lb = layer_of(e.source, layers), layer_of(e.target, layers)
        print(f"back-edge: {e.source} (layer {la}) -> {e.target} (layer {lb})  ({e.path}:{e.line})")
    for m in loose:
        print(f"unplaced module (no layer names it): {m}")
    problems = len(cycles) + len(back) + len(loose)
    if not quiet:
        n_edges = len({(e.source, e.target) for e in graph.edges})
        print(
            f"check_imports: {len(graph.modules)} modules, {n_edges} import arrows; "
            f"{len(cycles)} cycles, {len(back)} back-edges, {len(loose)} unplaced modules"
        )
    return problems


def main(argv: Sequence[str] | None = None) -> int:
    """Command line: check the package code under ``--root`` (default: the repository root)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", type=Path, default=Path(__file__).resolve().parent.parent)
    parser.add_argument("--packages", default=",".join(PACKAGES), help="comma-separated top-level packages")
    parser.add_argument("--quiet", action="store_true", help="print only the problems")
    args = parser.parse_args(argv)
    packages = [p for p in args.packages.split(",") if p]
    graph = build_graph(args.root.resolve(), packages)
    return 1 if report(graph, LAYERS, quiet=args.quiet) else 0


if __name__ == "__main__":
    sys.exit(main())
