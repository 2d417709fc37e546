"""The cost section of a sweep's ``report.md``: the paper's Table 3 (step time and throughput per
preset, the asynchronous speed-up over synchronous PPO, COPC's overhead over asynchronous PPO).

Per finished run, from its ``metrics.jsonl``: the median over RL steps ≥ 2 (step 1 includes the
engine's and the learner's warm-up; a one-step run uses its only step) of ``perf/step_s`` and of
``perf/tokens_per_s_per_device``; per cell, mean ± sd over seeds. When the grid has a ``preset``
axis with ``ppo``, ``ppo_async`` and ``copc`` values, each group of cells equal on every other
key also gets ``speed-up = step_s(ppo) / step_s(ppo_async)`` and
``overhead = step_s(copc) / step_s(ppo_async) − 1`` (the paper: 1.69–1.72× and 0.9–1.0 %).
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from pathlib import Path

from trainer.outputs.metrics_log import read_metrics

from .collect import RunRow, mean_sd
from .grid import format_value
from .plan import SweepPlan

STEP_KEY, THROUGHPUT_KEY = "perf/step_s", "perf/tokens_per_s_per_device"


@dataclass
class CellCost:
    """A cell's cost over its finished seeds: mean and sd of the per-run medians (NaN: none)."""

    cell: str
    values: dict[str, str]
    step_s: tuple[float, float]
    tokens_per_s_per_device: tuple[float, float]


def run_cost(run_dir: Path) -> tuple[float, float] | None:
    """``(median perf/step_s, median perf/tokens_per_s_per_device)`` of one run over its RL steps
    ≥ 2 (module docstring), None when its metrics have no step time."""
    rows = [r for r in read_metrics(run_dir) if STEP_KEY in r]
    late = [r for r in rows if r.get("step", 0) >= 2] or rows
    if not late:
        return None
    tput = [float(r[THROUGHPUT_KEY]) for r in late if THROUGHPUT_KEY in r]
    return statistics.median(float(r[STEP_KEY]) for r in late), statistics.median(tput) if tput else math.nan


def cell_costs(plan: SweepPlan, rows: list[RunRow]) -> list[CellCost]:
    """One :class:`CellCost` per cell, from the runs that finished (``status == "ok"``)."""
    ok = {(r.cell, r.seed) for r in rows if r.status == "ok"}
    per_cell: dict[str, list[tuple[float, float]]] = {}
    for run in plan.runs:
        cost = run_cost(run.run_dir) if (run.cell.id, run.seed) in ok else None
        if cost is not None:
            per_cell.setdefault(run.cell.id, []).append(cost)
    out = []
    for cell in plan.cells:
        costs = per_cell.get(cell.id, [])
        out.append(CellCost(cell.id, {k: format_value(v) for k, v in cell.values.items()},
                            mean_sd([c[0] for c in costs]), mean_sd([c[1] for c in costs])))
    return out


def _ratios(costs: list[CellCost]) -> list[str]:
    """The speed-up / overhead lines of each group of cells equal but for ``preset``."""
    groups: dict[tuple, dict[str, float]] = {}
    for c in costs:
        if "preset" in c.values:
            rest = tuple(sorted((k, v) for k, v in c.values.items() if k != "preset"))
            groups.setdefault(rest, {})[c.values["preset"]] = c.step_s[0]
    lines = []
    for rest, step in groups.items():
        if not all(math.isfinite(step.get(p, math.nan)) for p in ("ppo", "ppo_async", "copc")):
            continue
        where = ", ".join(f"{k}={v}" for k, v in rest) or "all runs"
        speedup, overhead = step["ppo"] / step["ppo_async"], 100 * (step["copc"] / step["ppo_async"] - 1)
        lines.append(f"- {where}: asynchronous speed-up over synchronous PPO {speedup:.2f}× (paper "
                     f"1.69–1.72×); COPC's overhead over asynchronous PPO {overhead:+.1f} % "
                     "(paper 0.9–1.0 %)")
    return lines


def _pm(m: tuple[float, float], fmt: str) -> str:
    mean, sd = m
    if not math.isfinite(mean):
        return "–"
    return format(mean, fmt) + ("" if not math.isfinite(sd) else " ± " + format(sd, fmt))


def cost_section(plan: SweepPlan, rows: list[RunRow]) -> list[str]:
    """The report's ``## Cost`` lines (empty when no finished run logged a step time)."""
    costs = cell_costs(plan, rows)
    if not any(math.isfinite(c.step_s[0]) for c in costs):
        return []
    keys = list(plan.spec.grid.keys)
    lines = ["## Cost (the paper's Table 3)", "",
             "Median over RL steps ≥ 2 of each run, then mean ± sd over its seeds: `perf/step_s` "
             "(wall seconds per step) and `perf/tokens_per_s_per_device` (trained model tokens per "
             "second per device: learner ranks + SGLang GPUs).", "",
             "| cell | " + " | ".join(f"`{k}`" for k in keys) + " | step s | tokens/s/device |",
             "|---|" + "---|" * len(keys) + "---|---|"]
    for c in costs:
        lines.append(f"| {c.cell} | " + " | ".join(c.values.get(k, "") for k in keys)
                     + f" | {_pm(c.step_s, '.3g')} | {_pm(c.tokens_per_s_per_device, '.4g')} |")
    ratios = _ratios(costs)
    return lines + (["", *ratios] if ratios else []) + [""]
