"""The experiment config is read only in the config and app layers (issue 41, "typed specs").

The import gate (``scripts/check_imports.py``) sees imports, not attribute reads: a learner backend
handed the whole :class:`~trainer.config.ExperimentConfig` could read ``cfg.train.actor_lr`` without
importing ``trainer.config``, a dependency on a higher layer that no arrow shows; a task, the loop
or a launcher handed it would depend on every section's schema. So this test reads every module of
a layer other than the config layer (``trainer.config``) and the app layers above it
(``trainer.app``, ``trainer.sweep``, ``trainer.cli``) with :mod:`ast` (nothing executed) and fails on
a read of an experiment-config section (``cfg.rollout``, ``exp_cfg.learner.lora``,
``getattr(cfg, "train")``, ...) through a name that holds the config. Components get typed specs
built where the run is assembled instead (``trainer/config/specs.py``, ``trainer/app/assemble.py``).
"""

from __future__ import annotations

import ast
import dataclasses
import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "check_imports.py"

#: Names (last part of the expression) that hold an experiment config in this code base.
CONFIG_NAMES = frozenset({"cfg", "_cfg", "config", "exp", "exp_cfg", "_exp_cfg", "experiment", "exp_config"})


def _check_imports():
    spec = importlib.util.spec_from_file_location("check_imports", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["check_imports"] = mod  # its dataclasses look their module up by name
    spec.loader.exec_module(mod)
    return mod


def _sections() -> frozenset[str]:
    """The experiment config's sections (its dataclass-typed fields: ``model``, ``train``, ...), the
    plain fields only the config holds (``algorithm``, ``plugins``, ``preset``, ``output_dir``) and
    its derived reads with names no spec uses (``algorithm_config()``, ``max_staleness``; its
    ``staleness`` is also a field of the loop's own ``LoopConfig``, so it is not listed)."""
    from trainer.config import ExperimentConfig

    cfg = ExperimentConfig()
    plain = {"algorithm", "plugins", "preset", "output_dir", "algorithm_config", "max_staleness"}
    return frozenset(f.name for f in dataclasses.fields(ExperimentConfig)
                     if dataclasses.is_dataclass(getattr(cfg, f.name))) | plain


def _holder(node: ast.expr) -> str | None:
    """The last name of ``node`` (``self.cfg`` -> ``cfg``, ``spec.exp`` -> ``exp``), or None."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    return None


def config_reads(path: Path, sections: frozenset[str], root: Path = ROOT) -> list[str]:
    """``"<file>:<line>: <expr>"`` (path relative to ``root``) for every read of a config section in
    the file at ``path``, in line order."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        attribute = isinstance(node, ast.Attribute) and node.attr in sections \
            and _holder(node.value) in CONFIG_NAMES
        via_getattr = isinstance(node, ast.Call) and isinstance(node.func, ast.Name) \
            and node.func.id == "getattr" and len(node.args) >= 2 and _holder(node.args[0]) in CONFIG_NAMES \
            and isinstance(node.args[1], ast.Constant) and node.args[1].value in sections
        if attribute or via_getattr:
            found.append((node.lineno, ast.unparse(node)))
    return [f"{path.relative_to(root)}:{line}: {expr}" for line, expr in sorted(found)]


def test_the_scan_finds_reads_through_every_spelling(tmp_path):
    """The scanner itself: each spelling of a section read is found, other attributes are not."""
    f = tmp_path / "m.py"
    f.write_text("def f(cfg, spec, self):\n"
                 "    a = cfg.train.actor_lr\n"
                 "    b = spec.exp.rollout\n"
                 "    c = getattr(self.exp_cfg, 'learner')\n"
                 "    d = self.model.train()\n"        # a model's train(): not a config read
                 "    e = cfg.dtype\n")                # a spec's own field: not a section
    got = config_reads(f, frozenset({"train", "rollout", "learner", "model"}), tmp_path)
    assert [g.split(": ", 1)[1] for g in got] == ["cfg.train", "spec.exp.rollout",
                                                  "getattr(self.exp_cfg, 'learner')"]


def _scanned(ci) -> dict[str, Path]:
    """The modules whose reads are refused: every placed module outside the config layer and the
    app layers (``trainer.app`` and above)."""
    config_layer, app_layer = ci.layer_of("trainer.config"), ci.layer_of("trainer.app")
    return {name: path for name, path in ci.find_modules(ROOT, ci.PACKAGES).items()
            if (layer := ci.layer_of(name)) is not None and layer != config_layer and layer < app_layer}


def test_only_the_config_and_app_layers_read_the_experiment_config():
    ci = _check_imports()
    scanned = _scanned(ci)
    for name in ("trainer.learner.base", "trainer.engines.registry", "trainer.tasks.base",  # the scan's reach
                 "trainer.warmstart.cache", "trainer.evaluate.heldout", "trainer.orchestration.loop",
                 "trainer.orchestration.ray_launcher"):
        assert name in scanned, name
    sections = _sections()
    assert {"train", "rollout", "learner", "model"} <= sections
    reads = [r for path in scanned.values() for r in config_reads(path, sections)]
    assert not reads, "experiment-config reads outside the config and app layers (give the component a " \
        "typed spec):\n" + "\n".join(reads)


@pytest.mark.parametrize("name", ["trainer.config.specs", "trainer.app.context", "trainer.app.assemble",
                                  "trainer.sweep", "trainer.cli"])
def test_the_layers_that_assemble_a_run_may_read_it(name):
    """The config and app layers are where the config is read: they are not scanned."""
    ci = _check_imports()
    assert ci.layer_of(name) is not None and name not in _scanned(ci)
