"""Sweep figures: Figure-1-style heatmaps (mean ± sd over seeds) and learning curves of every cell.

Heatmaps (COPC paper, Figure 1: η_P × η_A per staleness): x = one grid key, y = another, one
panel per value of a third (``panel_key``); a cell's colour is the mean of ``final`` or
``best`` over its finished seeds and its text is ``mean`` or ``mean ± sd`` (:func:`cell_text`),
exactly the numbers of ``sweep_cells.csv``. Further grid keys give one figure per combination
of their values. The drawn texts are read back from the Matplotlib artists and returned, so a
caller can check them against the CSV.

Matplotlib's object API with the Agg canvas (no pyplot: no global figure state, no display).
"""

from __future__ import annotations

import itertools
import json
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path

import matplotlib
import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from trainer.outputs.checkpoint import CheckpointManager
from trainer.outputs.metrics_log import read_metrics

from .collect import CellAgg
from .grid import Grid, format_value, heatmap_axes, short_names
from .plan import RunPlan

#: metrics.jsonl key of the mean training reward per step (:mod:`trainer.orchestration.loop`).
REWARD_KEY = "rollout/reward_mean"
_UNSAFE = re.compile(r"[^A-Za-z0-9._+=-]")


@dataclass(frozen=True)
class Annotation:
    """One heatmap cell as drawn.

    Attributes:
        figure: PNG path. panel: the panel key's value text (None without a panel key).
        x / y: value texts of the x / y keys (y None for a one-key grid).
        cell: cell id. mean / sd: the aggregate drawn. text: the text read back from the artist.
    """

    figure: str
    panel: str | None
    x: str
    y: str | None
    cell: str
    mean: float
    sd: float
    text: str


def cell_text(mean: float, sd: float, digits: int = 3) -> str:
    """``"0.512\\n± 0.031"``; ``"0.512"`` when sd is NaN (one seed); ``"n/a"`` when mean is NaN."""
    if math.isnan(mean):
        return "n/a"
    return f"{mean:.{digits}f}" if math.isnan(sd) else f"{mean:.{digits}f}\n± {sd:.{digits}f}"


def _draw(aggs: dict[tuple, CellAgg], grid: Grid, axes_keys: tuple, fixed: dict[str, str], value: str,
          metric: str, path: Path) -> list[Annotation]:
    """One figure (panels along the panel key) for the cells matching ``fixed`` (the rest keys)."""
    x, y, panel = axes_keys
    fmt = {k: [format_value(v) for v in vs] for k, vs in grid.axes.items()}
    panels = fmt[panel] if panel else [None]
    ys = fmt[y] if y else [None]
    fig = Figure(figsize=(1.0 + 1.15 * len(fmt[x]) * len(panels) + 1.2, 1.2 + 0.75 * len(ys) + 0.6))
    FigureCanvasAgg(fig)
    axs = fig.subplots(1, len(panels), squeeze=False)[0]

    def lookup(pv: str | None, yv: str | None, xv: str) -> CellAgg:
        want = {**fixed, x: xv, **({y: yv} if y else {}), **({panel: pv} if panel else {})}
        return aggs[tuple(want[k] for k in grid.keys)]

    means = [getattr(lookup(p, yv, xv), f"{value}_mean") for p in panels for yv in ys for xv in fmt[x]]
    finite = [m for m in means if math.isfinite(m)]
    vmin, vmax = (min(finite), max(finite)) if finite else (0.0, 1.0)
    if vmin == vmax:
        vmin, vmax = vmin - 0.5, vmax + 0.5
    cmap = matplotlib.colormaps["viridis"].with_extremes(bad="lightgrey")
    drawn: list[tuple[object, Annotation]] = []
    im = None
    for ax, pv in zip(axs, panels, strict=True):
        grid_m = np.full((len(ys), len(fmt[x])), np.nan)
        for i, yv in enumerate(ys):
            for j, xv in enumerate(fmt[x]):
                agg = lookup(pv, yv, xv)
                mean, sd = getattr(agg, f"{value}_mean"), getattr(agg, f"{value}_sd")
                grid_m[i, j] = mean
                shade = (mean - vmin) / (vmax - vmin) if math.isfinite(mean) else 1.0
                t = ax.text(j, i, cell_text(mean, sd), ha="center", va="center", fontsize=8,
                            color="white" if shade < 0.55 else "black")
                drawn.append((t, Annotation(str(path), pv, xv, yv, agg.cell, mean, sd, "")))
        im = ax.imshow(np.ma.masked_invalid(grid_m), cmap=cmap, vmin=vmin, vmax=vmax, aspect="auto")
        ax.set_xticks(range(len(fmt[x])), fmt[x])
        ax.set_yticks(range(len(ys)), ys if y else [""])
        ax.set_xlabel(x)
        if y and ax is axs[0]:
            ax.set_ylabel(y)
        if panel:
            ax.set_title(f"{panel} = {pv}", fontsize=10)
    fig.colorbar(im, ax=list(axs), label=f"{metric} ({value})", fraction=0.05, pad=0.02)
    rest = ", ".join(f"{k}={v}" for k, v in fixed.items())
    fig.suptitle(f"{value} {metric}: mean ± sd over seeds" + (f" ({rest})" if rest else ""), fontsize=10)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}.png")
    fig.savefig(tmp, dpi=120, bbox_inches="tight")
    os.replace(tmp, path)
    return [Annotation(**{**vars(a), "text": t.get_text()}) for t, a in drawn]


def plot_heatmaps(aggs: list[CellAgg], grid: Grid, out_dir: str | Path, metric: str, value: str = "final",
                  x_key: str | None = None, y_key: str | None = None,
                  panel_key: str | None = None) -> list[Annotation]:
    """Draw ``heatmap_<value>[_<rest>].png`` into ``out_dir``.

    Args:
        aggs: one aggregate per grid cell (:func:`trainer.sweep.collect.aggregate`).
        grid: the sweep grid. metric: the metric's name (labels only).
        value: ``final`` or ``best``. x_key / y_key / panel_key: see :func:`heatmap_axes`.

    Returns:
        Every drawn cell as an :class:`Annotation` whose ``text`` is read back from the figure.

    Raises:
        ConfigError: bad axis keys. ValueError: ``value`` not final/best, or a cell missing in ``aggs``.
    """
    if value not in ("final", "best"):
        raise ValueError(f"plot_heatmaps: value={value!r} must be 'final' or 'best'")
    x, y, panel, rest = heatmap_axes(grid.keys, x_key, y_key, panel_key)
    by_values = {tuple(a.values[k] for k in grid.keys): a for a in aggs}
    n_cells = math.prod(len(v) for v in grid.axes.values())
    if len(by_values) != n_cells:
        raise ValueError(f"plot_heatmaps: {len(by_values)} aggregates for a grid of {n_cells} cells")
    names = short_names(grid.keys)
    out_dir = Path(out_dir)
    annotations = []
    for combo in itertools.product(*[[format_value(v) for v in grid.axes[k]] for k in rest]):
        fixed = dict(zip(rest, combo, strict=True))
        suffix = "".join(f"_{names[k]}{_UNSAFE.sub('-', v)}" for k, v in fixed.items())
        annotations += _draw(by_values, grid, (x, y, panel), fixed, value, metric,
                             out_dir / f"heatmap_{value}{suffix}.png")
    return annotations


def _eval_points(run: RunPlan, metrics: list[dict], metric: str) -> tuple[list[int], list[float]]:
    """(step, value) of the run's evaluations: logged ones (the after-RL row, logged at
    ``total_steps + 1``, drawn at ``total_steps``) and post-hoc checkpoint results."""
    pts = [(min(r["step"], run.total_steps), float(r[f"eval/{metric}"])) for r in metrics
           if isinstance(r.get(f"eval/{metric}"), int | float)]
    for ckpt in run.checkpoints_to_evaluate():
        f = run.posthoc_file(ckpt)
        if f.is_file():
            v = json.loads(f.read_text()).get(metric)
            if isinstance(v, int | float):
                pts.append((CheckpointManager.step_of(ckpt), float(v)))
    pts.sort()
    return [p[0] for p in pts], [p[1] for p in pts]


def plot_curves(runs: list[RunPlan], path: str | Path, metric: str) -> Path | None:
    """Learning curves of every run in one figure: training reward (``rollout/reward_mean``) and
    the evaluation metric vs RL step; one colour per cell, one line per seed.

    Returns:
        ``path``, or None when no run has logged anything yet.
    """
    path = Path(path)
    data = [(r, read_metrics(r.run_dir)) for r in runs if (r.run_dir / "metrics.jsonl").is_file()]
    data = [(r, m) for r, m in data if m]
    if not data:
        return None
    fig = Figure(figsize=(12, 4.2), layout="constrained")
    FigureCanvasAgg(fig)
    ax_r, ax_e = fig.subplots(1, 2)
    cells = list(dict.fromkeys(r.cell.id for r, _ in data))
    colors = matplotlib.colormaps["tab20" if len(cells) > 10 else "tab10"]
    labelled: set[str] = set()
    for run, metrics in data:
        c = colors(cells.index(run.cell.id) % colors.N)
        label = None if run.cell.id in labelled else run.cell.id
        labelled.add(run.cell.id)
        xs = [r["step"] for r in metrics if isinstance(r.get(REWARD_KEY), int | float)]
        ys = [float(r[REWARD_KEY]) for r in metrics if isinstance(r.get(REWARD_KEY), int | float)]
        ax_r.plot(xs, ys, color=c, lw=1.0, alpha=0.85, label=label)
        ex, ey = _eval_points(run, metrics, metric)
        ax_e.plot(ex, ey, color=c, lw=1.0, marker="o", markersize=3, alpha=0.85)
    ax_r.set(xlabel="RL step", ylabel=REWARD_KEY, title="training reward")
    ax_e.set(xlabel="RL step", ylabel=f"eval {metric}", title=f"evaluation {metric} (step 0: before RL)")
    for ax in (ax_r, ax_e):
        ax.grid(alpha=0.3)
    fig.legend(loc="outside right upper", fontsize=7, title="cell", title_fontsize=8)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}.png")
    fig.savefig(tmp, dpi=110, bbox_inches="tight")
    os.replace(tmp, path)
    return path
