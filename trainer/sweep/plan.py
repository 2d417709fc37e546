"""The plan of a sweep: one validated :class:`RunPlan` per grid cell and seed, before anything runs.

Every run's full config (base YAML + ``overrides`` + the cell's keys + ``train.seed`` +
``output_dir``) is loaded with :func:`trainer.config.load_config` up front, so a bad key or
value stops the sweep with the config error naming the cell, before the first run starts.

Layout of a sweep directory ``OUT``::

    OUT/cells/<cell id>/seed<S>/              the run's output_dir (summary.json, metrics.jsonl,
                                              checkpoints/, posthoc_eval/step_XXXXXXXX.json)
    OUT/cells/<cell id>/seed<S>.log           stdout + stderr of every attempt (appended)
    OUT/cells/<cell id>/seed<S>.status.json   the last attempt: status, exit code, command
    OUT/warm_start_cache/<key>/               the warm-start shared by runs with equal settings
"""

from __future__ import annotations

import json
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from trainer.config import ExperimentConfig, load_config, plugin_metadata, to_yaml
from trainer.errors import ConfigError
from trainer.outputs.metrics_log import SUMMARY_FILE

from .grid import Cell, SweepSpec, check_key, format_value

#: Overrides every run gets first (the user's overrides win): a run's progress bar would only
#: clutter its log file.
DEFAULT_OVERRIDES = ("logging.progress=false",)
#: Metric names :func:`trainer.evaluate.heldout.summarize_records` reports (``avg@k`` / ``pass@k`` use the
#: run's ``eval.k``; ``em`` only for tasks with an exact-match reward component, e.g. search).
EVAL_METRICS = ("accuracy", "mean_reward", "em", "n", "episodes", "infra_failed", "mean_turns",
                "tool_call_rate", "mean_tool_calls", "mean_response_tokens")
POSTHOC_DIR = "posthoc_eval"
#: Where a sweep's cells share their warm-start (``warm_start.cache_dir``), inside the sweep directory.
WARM_START_CACHE = "warm_start_cache"
#: Config keys (dotted; a trailing ``.`` is a whole section) a run directory may differ in from the
#: plan when a sweep is re-run: where the sweep lives (it may be moved), the Ray cluster's address,
#: how many checkpoints are kept (``--eval-checkpoints``) and logging. Any other difference means
#: the directory holds a run of other settings.
RERUN_FREE_KEYS = ("output_dir", "warm_start.cache_dir", "launcher.settings.address", "checkpoint.keep_last",
                   "logging.")


@dataclass(frozen=True)
class RunPlan:
    """One training run of the sweep (a cell and a seed).

    Attributes:
        cell: the grid cell. seed: ``train.seed``.
        config: absolute path of the base YAML config.
        overrides: every ``key=value`` given to ``copc train`` / ``copc eval`` (``output_dir``
            and ``train.seed`` included), in order.
        run_dir: the run's ``output_dir``.
        total_steps: ``train.total_steps`` of the run (finished means this many steps).
        eval_checkpoints: evaluate its kept checkpoints post hoc after training.
    """

    cell: Cell
    seed: int
    config: str
    overrides: tuple[str, ...]
    run_dir: Path
    total_steps: int
    eval_checkpoints: bool = False

    @property
    def name(self) -> str:
        """``<cell id>/seed<S>`` (for messages)."""
        return f"{self.cell.id}/seed{self.seed}"

    @property
    def log(self) -> Path:
        """The log file (stdout and stderr of every attempt, appended)."""
        return self.run_dir.parent / f"seed{self.seed}.log"

    @property
    def status_file(self) -> Path:
        """JSON record of the last attempt (see :func:`trainer.sweep.runner.execute_run`)."""
        return self.run_dir.parent / f"seed{self.seed}.status.json"

    def train_command(self, resume: bool) -> list[str]:
        """``python -m trainer.cli train --config BASE <overrides> [--resume]``."""
        cmd = [sys.executable, "-m", "trainer.cli", "train", "--config", self.config, *self.overrides]
        return [*cmd, "--resume"] if resume else cmd

    def eval_command(self, checkpoint: Path) -> list[str]:
        """``python -m trainer.cli eval --config BASE <overrides> --checkpoint DIR``."""
        return [sys.executable, "-m", "trainer.cli", "eval", "--config", self.config, *self.overrides,
                "--checkpoint", str(checkpoint)]

    def summary(self) -> dict | None:
        """The run's ``summary.json``, or None when absent or unreadable (a run killed mid-write)."""
        try:
            return json.loads((self.run_dir / SUMMARY_FILE).read_text())
        except (OSError, ValueError):
            return None

    def train_finished(self) -> bool:
        """True iff ``summary.json`` records ``total_steps`` RL steps and the evaluation after RL."""
        s = self.summary()
        return s is not None and int(s.get("steps", -1)) >= self.total_steps and "eval_after" in s

    def posthoc_file(self, checkpoint: Path) -> Path:
        """Where the post-hoc evaluation of ``checkpoint`` is stored (JSON of the eval metrics)."""
        return self.run_dir / POSTHOC_DIR / f"{checkpoint.name}.json"

    def checkpoints_to_evaluate(self) -> list[Path]:
        """Kept checkpoints before the last step (the last step's weights are the ones the run's
        own after-RL evaluation scored), oldest first; empty without ``eval_checkpoints``."""
        from trainer.outputs.checkpoint import CheckpointManager  # torch: not needed to validate a sweep

        d = self.run_dir / "checkpoints"
        if not self.eval_checkpoints or not d.is_dir():
            return []
        return [c for c in CheckpointManager(d).checkpoints()
                if CheckpointManager.step_of(c) < self.total_steps]

    def pending_evals(self) -> list[Path]:
        """Checkpoints of :meth:`checkpoints_to_evaluate` without a stored post-hoc result."""
        return [c for c in self.checkpoints_to_evaluate() if not self.posthoc_file(c).is_file()]

    def done(self) -> bool:
        """Nothing left to do: training finished and every post-hoc evaluation stored."""
        return self.train_finished() and not self.pending_evals()


@dataclass
class SweepPlan:
    """A validated sweep.

    Attributes:
        spec: the resolved spec (``config`` absolute, ``seeds`` and ``metric`` filled in).
        out: absolute sweep directory. base: the base config with the common overrides.
        cells: the grid cells in order. runs: one plan per cell and seed (cell-major).
    """

    spec: SweepSpec
    out: Path
    base: ExperimentConfig
    cells: list[Cell]
    runs: list[RunPlan] = field(default_factory=list)

    @property
    def metric(self) -> str:
        """The evaluation metric compared across cells."""
        assert self.spec.metric is not None
        return self.spec.metric


def _override_key(o: str) -> str:
    key, eq, _ = o.partition("=")
    if not eq:
        raise ConfigError(f"override {o!r} must look like key=value")
    return key.strip()


def _check_metric(metric: str, cfg: ExperimentConfig, where: str) -> None:
    known = (*EVAL_METRICS, f"avg@{cfg.eval.k}", f"pass@{cfg.eval.k}")
    if metric not in known and not metric.startswith("finish/"):
        raise ConfigError(f"--metric {metric!r} ({where}): not an evaluation metric; known: {list(known)}")


def build_plan(spec: SweepSpec) -> SweepPlan:
    """Resolve ``spec`` and validate every run's config; nothing is started or written.

    Args:
        spec: the sweep spec (``config`` and a non-empty grid required).

    Returns:
        The :class:`SweepPlan`.

    Raises:
        ConfigError: no base config; an override that sets a grid key or a key the sweep sets
            (``output_dir``, ``train.seed``); a run whose config does not load (the message names
            the cell, the seed and the key); a run with ``eval.enabled=false``; an unknown metric;
            a grid over ``train.staleness.lag`` without ``train.staleness.mode=fixed`` (refused by the
            config: ``lag`` is no setting of the bounded mode); a run directory
            holding a run of other settings (:func:`_check_same_settings`).
    """
    if not spec.config:
        raise ConfigError("--config (or a spec's config:) is required")
    cells = spec.grid.cells()
    common = [*DEFAULT_OVERRIDES, *spec.overrides]
    for o in spec.overrides:
        key = check_key(_override_key(o), "override")
        if key in spec.grid.axes:
            raise ConfigError(f"override {o!r}: {key} is also a grid key (set it in one place)")
    config = str(Path(spec.config).resolve())
    try:
        base = load_config(config, common)
    except ConfigError as e:
        raise ConfigError(f"base config {spec.config}: {e}") from None
    seeds = spec.seeds if spec.seeds is not None else [base.train.seed]
    out = Path(spec.out or f"runs/sweeps/{base.name}").resolve()
    # cells differ in RL settings: they share one warm-start (the user's cache_dir, if any, wins)
    common = [*DEFAULT_OVERRIDES, f"warm_start.cache_dir={format_value(str(out / WARM_START_CACHE))}",
              *spec.overrides]
    metric = spec.metric or plugin_metadata(base, "task.env").get("headline_metric", "accuracy")
    resolved = SweepSpec(**{**vars(spec), "config": config, "seeds": seeds, "out": str(out),
                            "metric": metric})
    plan = SweepPlan(spec=resolved, out=out, base=base, cells=cells)
    for cell in cells:
        for seed in seeds:
            run_dir = out / "cells" / cell.id / f"seed{seed}"
            tail = [f"train.seed={seed}", f"output_dir={format_value(str(run_dir))}"]
            where = f"cell {cell.id} (seed {seed})"
            try:
                cfg = load_config(config, [*common, *cell.overrides(), *tail])
                keep = [] if not spec.eval_checkpoints else _keep_all(cfg)
                if keep:
                    cfg = load_config(config, [*common, *cell.overrides(), *keep, *tail])
            except ConfigError as e:
                raise ConfigError(f"{where}: {e}") from None
            if not cfg.eval.enabled:
                raise ConfigError(f"{where}: eval.enabled=False: a sweep compares evaluation metrics")
            _check_same_settings(cfg, run_dir, where)
            _check_metric(metric, cfg, where)
            plan.runs.append(RunPlan(cell, seed, config, (*common, *cell.overrides(), *keep, *tail), run_dir,
                                     cfg.train.total_steps, spec.eval_checkpoints))
    return plan


def _flatten(d: object, prefix: str = "") -> dict[str, object]:
    """``{"a": {"b": 1}}`` → ``{"a.b": 1}`` (lists and scalars are leaves)."""
    if not isinstance(d, dict):
        return {prefix: d}
    out: dict[str, object] = {}
    for k, v in d.items():
        out.update(_flatten(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v})
    return out


def _check_same_settings(cfg: ExperimentConfig, run_dir: Path, where: str) -> None:
    """Refuse to skip or resume a run whose directory was trained with other settings.

    A re-run of the sweep with a changed override, base config or spec would otherwise skip the
    finished runs (and report their numbers as the new settings') and resume the unfinished ones
    with mixed settings. The run's ``config.yaml`` (written by ``copc train`` at start) is
    compared with the planned config on the keys both have (a key only one has is a config field
    added or removed by a code change since), ignoring :data:`RERUN_FREE_KEYS`; a missing or
    unreadable one (a run killed before writing it) is not checked.

    Raises:
        ConfigError: naming the run, up to five differing keys with both values, and the fixes.
    """
    saved = run_dir / "config.yaml"
    try:
        old = yaml.safe_load(saved.read_text())
    except (OSError, yaml.YAMLError):
        return
    if not isinstance(old, dict):
        return
    a, b = _flatten(old), _flatten(yaml.safe_load(to_yaml(cfg)))
    free = tuple(k for k in RERUN_FREE_KEYS if not k.endswith("."))
    sections = tuple(k for k in RERUN_FREE_KEYS if k.endswith("."))
    # keys in only one of them are fields added or removed by a code change since that run
    diff = [k for k in sorted(set(a) & set(b))
            if a[k] != b[k] and k not in free and not k.startswith(sections)]
    if diff:
        shown = ", ".join(f"{k}: {a[k]!r} there, {b[k]!r} now" for k in diff[:5])
        more = f" (and {len(diff) - 5} more)" if len(diff) > 5 else ""
        raise ConfigError(f"{where}: {run_dir} holds a run with other settings ({shown}{more}); "
                          "use another --out, or delete that run's directory to re-run it")


def _keep_all(cfg: ExperimentConfig) -> list[str]:
    """``checkpoint.keep_last`` large enough to keep every checkpoint of the run (or nothing)."""
    need = math.ceil(cfg.train.total_steps / cfg.checkpoint.every_steps)
    return [f"checkpoint.keep_last={need}"] if cfg.checkpoint.keep_last < need else []
