"""Collect a sweep's results: one row per cell × seed (``sweep.csv``), one per cell (``sweep_cells.csv``).

Per run, from its output directory:

* ``final``: the evaluation metric after RL (``summary.json`` → ``eval_after[metric]``).
* ``best``: the maximum of the metric over the evaluations of the RL policy: ``final``, any
  evaluation the run logged itself at a step ``1 <= step <= total_steps`` (``eval/<metric>`` in
  ``metrics.jsonl``; ``copc train`` logs only before and after RL today), and with
  ``--eval-checkpoints`` the post-hoc evaluations of the kept checkpoints. The evaluation
  before RL (after the warm-start, step 0) is excluded: it scores the common starting point, not
  the effect of the cell's settings, and would hide every cell whose RL did not improve on it.
  ``best_step`` is the step where it was reached (the earliest on ties; ``total_steps`` for final).

Per cell: ``n_ok`` runs that finished, ``n_failed`` that did not, and mean ± sample standard
deviation (``ddof = 1``; NaN for one seed) of ``final`` and ``best`` over the finished runs.
"""

from __future__ import annotations

import csv
import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path

from trainer.errors import ConfigError
from trainer.outputs.checkpoint import CheckpointManager
from trainer.outputs.metrics_log import read_metrics

from .grid import Cell
from .plan import RunPlan, SweepPlan

NAN = float("nan")


@dataclass
class RunRow:
    """Result of one run (a ``sweep.csv`` row).

    Attributes:
        cell: cell id. values: grid key → value text. seed: ``train.seed``.
        status: ``ok`` (trained, and evaluated post hoc when asked) | ``failed`` | ``interrupted``
            | ``pending`` (not run yet).
        final / best: the metric after RL / the best over the run's evaluations (NaN if unknown).
        best_step: RL step of ``best`` (None if unknown). steps: RL steps done (None if unknown).
        wall_s: the run's wall time in seconds (``summary.json``; resumes included; NaN if unknown).
        returncode: exit status of the last command of the last attempt (None if never run).
        log: the run's log file.
    """

    cell: str
    values: dict[str, str]
    seed: int
    status: str
    final: float
    best: float
    best_step: int | None
    steps: int | None
    wall_s: float
    returncode: int | None
    log: str


@dataclass
class CellAgg:
    """Aggregate of one cell over its seeds (a ``sweep_cells.csv`` row).

    Attributes:
        cell: cell id. values: grid key → value text. n_ok / n_failed: runs finished / not.
        final_mean, final_sd, best_mean, best_sd: over finished runs (NaN when none; sd NaN for one).
    """

    cell: str
    values: dict[str, str]
    n_ok: int
    n_failed: int
    final_mean: float
    final_sd: float
    best_mean: float
    best_sd: float


def mean_sd(xs: list[float]) -> tuple[float, float]:
    """Mean and sample standard deviation (``ddof = 1``) of ``xs``; ``(nan, nan)`` for none, sd
    ``nan`` for one value."""
    n = len(xs)
    if n == 0:
        return NAN, NAN
    m = math.fsum(xs) / n
    if n == 1:
        return m, NAN
    return m, math.sqrt(math.fsum((x - m) ** 2 for x in xs) / (n - 1))


def _metric(evals: dict, metric: str, where: str) -> float:
    if metric not in evals:
        raise ConfigError(f"--metric {metric!r}: not in the evaluation of {where}; available: "
                          f"{sorted(k for k, v in evals.items() if isinstance(v, int | float))}")
    return float(evals[metric])


def best_of(plan: RunPlan, final: float, metric: str) -> tuple[float, int | None]:
    """``(best, best_step)`` of a finished run (see the module docstring).

    Raises:
        ConfigError: a post-hoc result lacks ``metric``. ValueError: an unreadable metrics file.
    """
    cands: list[tuple[int, float]] = []
    for rec in read_metrics(plan.run_dir):
        v = rec.get(f"eval/{metric}")
        if isinstance(v, int | float) and 1 <= rec["step"] < plan.total_steps:
            cands.append((rec["step"], float(v)))
    cands.append((plan.total_steps, final))
    for ckpt in plan.checkpoints_to_evaluate():
        f = plan.posthoc_file(ckpt)
        if f.is_file():
            step = CheckpointManager.step_of(ckpt)
            cands.append((step, _metric(json.loads(f.read_text()), metric, str(f))))
    cands = sorted(c for c in cands if not math.isnan(c[1]))
    if not cands:
        return NAN, None
    top = max(v for _, v in cands)
    return top, next(s for s, v in cands if v == top)


def run_row(plan: RunPlan, metric: str) -> RunRow:
    """The :class:`RunRow` of ``plan`` from its directory and status file.

    Raises:
        ConfigError: a finished run's evaluation lacks ``metric`` (lists the metrics it has).
    """
    status_rec = {}
    if plan.status_file.is_file():
        try:
            status_rec = json.loads(plan.status_file.read_text())
        except ValueError:
            status_rec = {}
    if plan.done():
        status = "ok"
    else:
        status = status_rec.get("status", "pending")
        status = "pending" if status == "ok" else status
    final, best, best_step, steps, wall = NAN, NAN, None, None, NAN
    summary = plan.summary()
    if plan.train_finished() and summary is not None:
        final = _metric(summary["eval_after"], metric, str(plan.run_dir / "summary.json"))
        best, best_step = best_of(plan, final, metric)
        steps, wall = int(summary["steps"]), float(summary.get("wall_s", NAN))
    return RunRow(plan.cell.id, {k: plan.cell.label(k) for k in plan.cell.values}, plan.seed, status,
                  final, best, best_step, steps, wall, status_rec.get("returncode"), str(plan.log))


def collect(plan: SweepPlan) -> list[RunRow]:
    """One :class:`RunRow` per run of ``plan``, in plan order (cell-major, then seed)."""
    return [run_row(r, plan.metric) for r in plan.runs]


def aggregate(rows: list[RunRow], cells: list[Cell]) -> list[CellAgg]:
    """One :class:`CellAgg` per cell, in grid order, over the ``ok`` rows of that cell."""
    out = []
    for cell in cells:
        mine = [r for r in rows if r.cell == cell.id]
        ok = [r for r in mine if r.status == "ok"]
        fm, fs = mean_sd([r.final for r in ok])
        bm, bs = mean_sd([r.best for r in ok])
        out.append(CellAgg(cell.id, {k: cell.label(k) for k in cell.values}, len(ok), len(mine) - len(ok),
                           fm, fs, bm, bs))
    return out


def _flat(obj: RunRow | CellAgg) -> dict:
    d = asdict(obj)
    values = d.pop("values")
    cell = d.pop("cell")
    return {"cell": cell, **values, **{k: "" if v is None else v for k, v in d.items()}}


def write_csv(items: list[RunRow] | list[CellAgg], path: str | Path) -> Path:
    """Write rows (``cell``, the grid keys, then the other fields; floats in full precision via
    ``repr``, NaN as ``nan``, None as empty) to ``path``.

    Raises:
        ValueError: ``items`` is empty.
    """
    if not items:
        raise ValueError(f"write_csv({path}): no rows")
    rows = [_flat(i) for i in items]
    path = Path(path)
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    return path
