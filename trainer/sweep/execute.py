"""Run a validated sweep plan with a progress display, then write its tables, figures and report."""

from __future__ import annotations

import sys
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from trainer.config import plugin_metadata, plugin_settings
from trainer.errors import ConfigError
from trainer.ray_util import RayClusterSettings

from .collect import CellAgg, RunRow, aggregate, collect, write_csv
from .plan import RunPlan, SweepPlan
from .plots import Annotation, plot_curves, plot_heatmaps
from .report import write_report
from .runner import LocalPool, RayPool, run_all


def ray_cluster(plan: SweepPlan) -> tuple[str, int]:
    """``(address, num_cpus)`` of the Ray cluster the base config's launcher runs on (its settings,
    a :class:`~trainer.ray_util.RayClusterSettings`: ``launcher.settings.address`` / ``num_cpus``).

    Raises:
        ConfigError: the launcher has the ``ray_cluster`` capability but its settings are not a
            ``RayClusterSettings`` (naming ``launcher.kind``).
    """
    settings = plugin_settings(plan.base, "launcher.kind")
    if not isinstance(settings, RayClusterSettings):
        raise ConfigError(f"launcher.kind={plan.base.launcher.kind!r}: a ray_cluster launcher's settings "
                          "must be a trainer.ray_util.RayClusterSettings (address, num_cpus) for copc sweep "
                          f"to run its cells on that cluster; got {type(settings).__name__}")
    return settings.address, settings.num_cpus


def run_plan(plan: SweepPlan, console: Console) -> dict[str, dict]:
    """Run every run of ``plan`` that is not done (``parallel`` at a time; Ray tasks when the base
    config has ``launcher.kind=ray``), showing cells done / running / failed.

    Returns:
        ``{run name: status record}`` of the runs started.

    Raises:
        KeyboardInterrupt: after stopping the runs in flight.
    """
    todo = [r for r in plan.runs if not r.done()]
    skipped = len(plan.runs) - len(todo)
    counts = {"running": 0, "ok": 0, "failed": 0}
    console.print(f"copc sweep: {len(plan.runs)} run(s) in {plan.out}: {skipped} already done, "
                  f"{len(todo)} to run")
    if not todo:
        return {}
    on_ray = plugin_metadata(plan.base, "launcher.kind")["ray_cluster"]  # the runs' launcher uses Ray
    pool = RayPool(*ray_cluster(plan)) if on_ray else LocalPool(plan.spec.parallel)

    def describe() -> str:
        return (f"sweep: {counts['ok'] + skipped} done, {counts['running']} running, "
                f"{counts['failed']} failed")

    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=console) as progress:
        task = progress.add_task(describe(), total=len(plan.runs), completed=skipped)

        def on_event(kind: str, run: RunPlan, rec: dict | None) -> None:
            if kind == "start":
                counts["running"] += 1
            else:
                assert rec is not None
                counts["running"] -= 1
                counts["ok" if rec["status"] == "ok" else "failed"] += 1
                extra = "" if rec["status"] == "ok" else \
                    f" (exit {rec.get('returncode')}, stage {rec.get('stage')}; log: {run.log})"
                progress.console.print(f"{run.name}: {rec['status']}{extra}")
            progress.update(task, description=describe(), advance=1 if kind == "end" else 0)

        return run_all(todo, pool, plan.spec.parallel, on_event)


def write_outputs(plan: SweepPlan, command: str) -> tuple[list[RunRow], list[CellAgg], list[Annotation]]:
    """Collect the results and write ``sweep.csv``, ``sweep_cells.csv``, the heatmaps, ``curves.png``
    and ``report.md`` into ``plan.out``.

    Returns:
        (rows, per-cell aggregates, heatmap annotations as drawn).

    Raises:
        ConfigError: the metric is missing from a finished run's evaluation.
    """
    rows = collect(plan)
    aggs = aggregate(rows, plan.cells)
    write_csv(rows, plan.out / "sweep.csv")
    write_csv(aggs, plan.out / "sweep_cells.csv")
    spec = plan.spec
    annotations: list[Annotation] = []
    for value in ("final", "best"):
        annotations += plot_heatmaps(aggs, spec.grid, plan.out, plan.metric, value, spec.x_key, spec.y_key,
                                     spec.panel_key)
    figures = list(dict.fromkeys(Path(a.figure) for a in annotations))
    curves = plot_curves(plan.runs, plan.out / "curves.png", plan.metric)
    figures += [curves] if curves else []
    write_report(plan, rows, aggs, figures, command)
    return rows, aggs, annotations


def execute_and_report(plan: SweepPlan, command: str) -> int:
    """:func:`run_plan` then :func:`write_outputs` (also after Ctrl-C, for what has finished).

    Returns:
        0 when every run is ``ok``, 1 otherwise, 2 when the metric is missing, 130 after Ctrl-C.
    """
    console = Console(stderr=True)
    interrupted = False
    try:
        run_plan(plan, console)
    except KeyboardInterrupt:
        interrupted = True
        console.print(f"copc sweep: interrupted; runs in flight stopped. Resume with: {command}")
    try:
        rows, _, _ = write_outputs(plan, command)
    except ConfigError as e:
        print(f"copc sweep: config error: {e}", file=sys.stderr)
        return 2
    bad = [r for r in rows if r.status != "ok"]
    console.print(f"copc sweep: {len(rows) - len(bad)}/{len(rows)} run(s) ok; "
                  f"report: {plan.out / 'report.md'}")
    for r in bad:
        console.print(f"  {r.cell}/seed{r.seed}: {r.status} (exit {r.returncode}); log: {r.log}")
    if interrupted:
        return 130
    return 0 if not bad else 1
