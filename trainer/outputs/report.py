"""The end-of-run console report (rich table of evaluation before/after RL, with 95 % intervals)."""

from __future__ import annotations

import math
from typing import Any

#: Suffixes of the interval bounds that :func:`trainer.evaluate.heldout.summarize_records` adds to a metric.
CI_LOW, CI_HIGH = "_ci95_low", "_ci95_high"


def _fmt(v: Any) -> str:
    return "—" if v is None else (f"{v:.3f}" if isinstance(v, float) else str(v))


def format_with_ci(metrics: dict, key: str) -> str:
    """``metrics[key]`` as ``"0.051 [0.032, 0.080]"`` when its 95 % interval
    (``<key>_ci95_low`` / ``<key>_ci95_high``) is there and finite, else as a plain number
    (``"—"`` when the metric is missing)."""
    v = metrics.get(key)
    low, high = metrics.get(key + CI_LOW), metrics.get(key + CI_HIGH)
    if isinstance(v, int | float) and isinstance(low, int | float) and isinstance(high, int | float) \
            and math.isfinite(low) and math.isfinite(high):
        return f"{v:.3f} [{low:.3f}, {high:.3f}]"
    return _fmt(v)


def format_delta(delta: dict) -> str:
    """An ``eval_delta`` (:func:`trainer.evaluate.heldout.paired_difference`) as
    ``"+0.030 [+0.010, +0.050] (n=334)"``; ``"—"`` when it has no paired question."""
    if not delta or not delta.get("n"):
        return "—"
    return f"{delta['mean']:+.3f} [{delta['ci95_low']:+.3f}, {delta['ci95_high']:+.3f}] (n={delta['n']})"


#: Widest metric label printed on one line (longer ones fold; 80 columns leave ~45 for the values).
LABEL_WIDTH = 28


def print_report(summary: dict, console: Any = None) -> None:
    """Print the before/after table (rich) and where the outputs are.

    Metrics with a 95 % interval (accuracy, em) show it in brackets; with an ``eval_delta`` the
    table gets a column with the paired change after − before of that metric and its 95 %
    paired bootstrap interval.

    Args:
        summary: the run summary (``eval_before`` / ``eval_after`` metric dicts, ``eval_delta``,
            ``steps``, ``episodes``, ``dropped_stale``, ``infra_failed``, ``wall_s`` in seconds,
            ``output_dir``, ``train_tail``: :func:`~trainer.outputs.metrics_log.last_steps_mean`
            output, printed as one line when present).
        console: a ``rich.console.Console`` to print to (default:
            :func:`~trainer.outputs.progress.report_console`, wide when stdout is not a terminal).
    """
    from rich.table import Table

    from .progress import report_console

    con = console if console is not None else report_console()
    delta = summary.get("eval_delta") or {}
    table = Table(title=f"{summary.get('name')} — {summary.get('preset')} on {summary.get('task')}")
    columns = ["after warm-start (before RL)" if summary.get("warm_start") else "before RL", "after RL"]
    columns += ["Δ after − before (paired)"] if delta else []
    before, after = summary.get("eval_before", {}), summary.get("eval_after", {})
    keys = [k for k in sorted(set(before) | set(after))
            if not k.endswith((CI_LOW, CI_HIGH)) and isinstance(before.get(k, after.get(k)), int | float)]
    # labels of up to LABEL_WIDTH characters never wrap or shrink; a longer one folds onto more
    # lines (every character kept) so the value columns keep their room; on a narrow terminal
    # (80 columns, stdout not a tty) the value columns wrap at their spaces ("0.051" over
    # "[0.032, 0.080]")
    width = max([len("metric")] + [len(k) for k in keys])
    table.add_column("metric", min_width=min(width, LABEL_WIDTH), max_width=max(LABEL_WIDTH, len("metric")),
                     overflow="fold", no_wrap=width <= LABEL_WIDTH)
    for name in columns:
        table.add_column(name, justify="right", min_width=len("+0.000 ["))
    for k in keys:
        row = [k, format_with_ci(before, k), format_with_ci(after, k)]
        if delta:
            row.append(format_delta(delta) if k == delta.get("metric") else "")
        table.add_row(*row)
    con.print(table)
    if before.get("accuracy" + CI_LOW) is not None or after.get("accuracy" + CI_LOW) is not None:
        con.print("In brackets: 95 % interval (Wilson score; avg@k with k > 1 at the effective sample size)"
                  + ("; Δ: mean per-question change, 95 % paired bootstrap" if delta else ""))
    con.print(f"RL steps: {summary.get('steps')}, episodes: {summary.get('episodes')}, dropped as stale: "
              f"{summary.get('dropped_stale')}, infrastructure failures: {summary.get('infra_failed', 0)}, "
              f"wall time: {summary.get('wall_s', 0):.0f} s; "
              f"outputs in {summary.get('output_dir')}")
    tail = summary.get("train_tail") or {}
    if tail.get("steps"):
        parts = [f"{k.split('/')[-1].replace('_', ' ')} {tail[k]:.3f}" for k in sorted(tail)
                 if k.startswith("rollout/")]
        con.print(f"Training, last {tail['frac']:.0%} of RL steps (steps {tail['steps'][0]}–"
                  f"{tail['steps'][1]}), mean per step: " + ", ".join(parts))
