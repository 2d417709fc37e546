"""``report.md`` of a sweep: settings, grid, per-cell table, best cell, figures and failed runs."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

from .collect import CellAgg, RunRow
from .cost import cost_section
from .grid import format_value
from .plan import SweepPlan
from .plots import cell_text

BEST_RULE = ("`final`: the metric of the evaluation after RL. `best`: the maximum over the RL "
             "policy's evaluations (final, evaluations the run logged during RL, and with "
             "`--eval-checkpoints` every kept checkpoint evaluated post hoc); the evaluation before "
             "RL (after the warm-start) is not included. Mean ± sample sd (ddof 1) over the seeds "
             "that finished.")


def _pm(mean: float, sd: float) -> str:
    return cell_text(mean, sd).replace("\n", " ")


def _best(aggs: list[CellAgg], field: str) -> CellAgg | None:
    ok = [a for a in aggs if math.isfinite(getattr(a, f"{field}_mean"))]
    return max(ok, key=lambda a: getattr(a, f"{field}_mean")) if ok else None


def _rel(path: str | Path, root: Path) -> str:
    return os.path.relpath(path, root)


def write_report(plan: SweepPlan, rows: list[RunRow], aggs: list[CellAgg], figures: list[Path],
                 command: str = "") -> Path:
    """Write ``<out>/report.md`` and return its path.

    Args:
        plan: the sweep. rows / aggs: :func:`~trainer.sweep.collect.collect` /
            :func:`~trainer.sweep.collect.aggregate` results. figures: PNGs to link (under ``out``).
        command: the command line that ran the sweep (shown so it can be re-run to resume).
    """
    out, spec, keys = plan.out, plan.spec, list(plan.spec.grid.keys)
    counts = {s: sum(r.status == s for r in rows) for s in ("ok", "failed", "interrupted", "pending")}
    lines = [f"# Sweep: {plan.base.name} ({len(plan.cells)} cells × {len(spec.seeds or [])} seed(s))", ""]
    lines += [f"- base config: `{spec.config}`",
              f"- overrides for every run: `{' '.join(spec.overrides) or '(none)'}`",
              f"- seeds: {', '.join(map(str, spec.seeds or []))}",
              f"- metric: `{plan.metric}` (evaluation: {plan.base.eval.num_samples} problems, "
              f"k = {plan.base.eval.k}, temperature {plan.base.eval.temperature})",
              f"- post-hoc checkpoint evaluation: {'yes' if spec.eval_checkpoints else 'no'}",
              f"- runs: {counts['ok']} ok, {counts['failed']} failed, {counts['interrupted']} interrupted, "
              f"{counts['pending']} pending"]
    if command:
        lines.append(f"- command (re-run it to resume): `{command}`")
    lines += ["", "## Grid", "", "| key | values |", "|---|---|"]
    lines += [f"| `{k}` | {', '.join(format_value(v) for v in vs)} |" for k, vs in spec.grid.axes.items()]
    lines += ["", f"## Results: `{plan.metric}`", "", BEST_RULE, "",
              "| cell | " + " | ".join(f"`{k}`" for k in keys) + " | seeds ok | failed | final | best |",
              "|---|" + "---|" * len(keys) + "---|---|---|---|"]
    for a in aggs:
        lines.append(f"| {a.cell} | " + " | ".join(a.values[k] for k in keys)
                     + f" | {a.n_ok} | {a.n_failed} | {_pm(a.final_mean, a.final_sd)} | "
                       f"{_pm(a.best_mean, a.best_sd)} |")
    lines += ["", "## Best cell", ""]
    for field in ("final", "best"):
        b = _best(aggs, field)
        lines.append(f"- by mean {field}: " + ("none finished" if b is None else
                     f"**{b.cell}** ({', '.join(f'{k}={v}' for k, v in b.values.items())}): "
                     f"{_pm(getattr(b, f'{field}_mean'), getattr(b, f'{field}_sd'))}"))
    lines += ["", *cost_section(plan, rows), "## Figures", ""]
    lines += [f"![{p.stem}]({_rel(p, out)})" for p in figures] or ["(none)"]
    lines += ["", "Tables: [sweep.csv](sweep.csv) (one row per cell × seed), "
                  "[sweep_cells.csv](sweep_cells.csv) (one row per cell)."]
    bad = [r for r in rows if r.status != "ok"]
    lines += ["", "## Failed or unfinished runs", ""]
    if not bad:
        lines.append("(none)")
    else:
        lines += ["| run | status | exit code | stage | error | log |", "|---|---|---|---|---|---|"]
        for r in bad:
            rec = _status_record(Path(r.log).with_name(f"seed{r.seed}.status.json"))
            lines.append(f"| {r.cell}/seed{r.seed} | {r.status} | "
                         f"{'' if r.returncode is None else r.returncode} | {rec.get('stage', '')} | "
                         f"{rec.get('error') or ''} | [{_rel(r.log, out)}]({_rel(r.log, out)}) |")
    path = out / "report.md"
    path.write_text("\n".join(lines) + "\n")
    return path


def _status_record(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
