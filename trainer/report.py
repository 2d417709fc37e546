"""The end-of-run console report (rich table of evaluation before/after RL)."""

from __future__ import annotations

from typing import Any


def _fmt(v: Any) -> str:
    return "—" if v is None else (f"{v:.3f}" if isinstance(v, float) else str(v))


def print_report(summary: dict) -> None:
    """Print the before/after table (rich) and where the outputs are.

    Args:
        summary: the run summary (``eval_before`` / ``eval_after`` metric dicts, ``steps``,
            ``episodes``, ``dropped_stale``, ``infra_failed``, ``wall_s`` in seconds, ``output_dir``).
    """
    from rich.console import Console
    from rich.table import Table

    con = Console()
    table = Table(title=f"{summary.get('name')} — {summary.get('preset')} on {summary.get('task')}")
    table.add_column("metric")
    table.add_column("after warm-start (before RL)" if summary.get("warm_start") else "before RL",
                     justify="right")
    table.add_column("after RL", justify="right")
    before, after = summary.get("eval_before", {}), summary.get("eval_after", {})
    for k in sorted(set(before) | set(after)):
        if isinstance(before.get(k, after.get(k)), int | float):
            table.add_row(k, _fmt(before.get(k)), _fmt(after.get(k)))
    con.print(table)
    con.print(f"RL steps: {summary.get('steps')}, episodes: {summary.get('episodes')}, dropped as stale: "
              f"{summary.get('dropped_stale')}, infrastructure failures: {summary.get('infra_failed', 0)}, "
              f"wall time: {summary.get('wall_s', 0):.0f} s; "
              f"outputs in {summary.get('output_dir')}")
