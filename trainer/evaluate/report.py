"""Evaluation report files: ``report.json``, ``report.md`` and ``report.png``.

:func:`write_report` takes the run header (model, engine, k, temperature, seeds, date, ...) and
the per-benchmark metric dicts of :func:`trainer.evaluate.metrics.summarize_benchmark`, and
writes, each atomically (temporary sibling, fsync, ``os.replace``):

============ =================================================================================
file         content
============ =================================================================================
report.json  ``{"header": header, "benchmarks": per_benchmark}`` (non-finite floats -> null)
report.md    the header as a list, then one table: a row per benchmark with its headline
             metric and 95 % CI (``0.412 [0.35, 0.47]``), secondary metrics, the
             questions / episodes scored, the failed (excluded) counts and its k,
             temperature and seed; then each benchmark's config (env, data, kind, settings)
report.png   grouped bar chart: per benchmark, its headline metric then its secondary
             metrics with 95 % CI error bars (matplotlib object API, Agg canvas)
============ =================================================================================
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from trainer.evaluate.metrics import CI_SUFFIX

HEADER_ORDER = ("model", "engine", "k", "temperature", "seeds", "date")
_MATH_RE = re.compile(r"^(avg|maj|pass)@(\d+)$")


def _jsonable(v: Any) -> Any:
    """``v`` with non-finite floats as ``None``, tuples as lists and paths as strings."""
    if isinstance(v, float):
        return v if math.isfinite(v) else None
    if isinstance(v, Mapping):
        return {str(k): _jsonable(x) for k, x in v.items()}
    if isinstance(v, list | tuple):
        return [_jsonable(x) for x in v]
    if isinstance(v, Path):
        return str(v)
    if hasattr(v, "item") and callable(v.item):  # numpy scalar
        return _jsonable(v.item())
    return v


def _atomic_write(path: Path, write: Callable[[Path], None]) -> Path:
    """Call ``write(tmp)`` on a temporary sibling of ``path``, fsync it, then ``os.replace`` it."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}{path.suffix}")
    try:
        write(tmp)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path


def _write_text(path: Path, text: str) -> Path:
    return _atomic_write(path, lambda tmp: tmp.write_text(text, encoding="utf-8"))


def headline_metric(summary: Mapping[str, Any]) -> str | None:
    """The headline metric name of a benchmark summary: its ``headline`` key, else the first of
    ``avg@<n>`` / ``em`` / ``accuracy`` present, else ``None``."""
    name = summary.get("headline")
    if isinstance(name, str) and name in summary:
        return name
    for key in summary:
        if key.startswith("avg@") and _MATH_RE.match(key):
            return key
    for key in ("em", "accuracy"):
        if key in summary:
            return key
    return None


def secondary_metrics(summary: Mapping[str, Any]) -> list[str]:
    """Secondary metrics shown next to the headline: ``maj@n`` and the largest ``pass@k`` for math,
    ``f1`` and ``cover_em`` for QA (those present, in that order)."""
    if summary.get("kind") == "qa" or "em" in summary:
        return [m for m in ("f1", "cover_em") if m in summary]
    out = [k for k in summary if k.startswith("maj@") and _MATH_RE.match(k)]
    passes = [k for k in summary if k.startswith("pass@") and _MATH_RE.match(k)]
    if passes:
        out.append(max(passes, key=lambda k: int(k.split("@")[1])))
    return out


def format_metric(value: Any, ci: Any = None) -> str:
    """``0.412 [0.35, 0.47]``: the value to 3 decimals and its CI to 2; ``—`` for a missing value."""
    if not isinstance(value, int | float) or isinstance(value, bool) or not math.isfinite(value):
        return "—"
    text = f"{value:.3f}"
    if isinstance(ci, list | tuple) and len(ci) == 2 and all(isinstance(x, int | float) for x in ci):
        text += f" [{ci[0]:.2f}, {ci[1]:.2f}]"
    return text


def _fmt_header_value(v: Any) -> str:
    if isinstance(v, list | tuple):
        return ", ".join(str(x) for x in v)
    return str(v)


def render_markdown(header: Mapping[str, Any], per_benchmark: Mapping[str, Mapping[str, Any]]) -> str:
    """The text of ``report.md`` (see the module docstring)."""
    lines = ["# Evaluation report", ""]
    keys = [k for k in HEADER_ORDER if k in header] + sorted(k for k in header if k not in HEADER_ORDER)
    lines += [f"- **{k}**: {_fmt_header_value(header[k])}" for k in keys]
    lines += ["", "| benchmark | metric | score [95% CI] | other | questions | episodes | "
              "failed episodes | failed questions | k | temperature | seed |",
              "|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for name, s in per_benchmark.items():
        head = headline_metric(s)
        score = format_metric(s.get(head), s.get(f"{head}{CI_SUFFIX}")) if head else "—"
        other = "; ".join(f"{m} {format_metric(s.get(m), s.get(m + CI_SUFFIX))}"
                          for m in secondary_metrics(s))
        cells = [name, head or "—", score, other or "—"] + [
            str(s.get(k, "—")) for k in ("questions", "episodes", "failed_episodes", "failed_questions",
                                         "k", "temperature", "seed")]
        lines.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    configs = [(name, s["config"]) for name, s in per_benchmark.items()
               if isinstance(s.get("config"), Mapping)]
    if configs:
        lines += ["", "Benchmark configs:", ""]
        lines += [f"- **{name}**: " + ", ".join(f"{k}={json.dumps(v, sort_keys=True)}" for k, v in c.items()
                                                  if v not in ({}, None, "")) for name, c in configs]
    lines += ["", "Scores are means over questions; the interval is a 95 % percentile bootstrap over "
              "questions. Infrastructure failures are excluded from every metric and counted, never "
              "scored 0 (see docs/evaluation.md).", ""]
    return "\n".join(lines)


def _plot(path: Path, per_benchmark: Mapping[str, Mapping[str, Any]]) -> Path:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    groups: list[tuple[str, list[tuple[str, float, tuple[float, float] | None]]]] = []
    metric_names: list[str] = []
    for name, s in per_benchmark.items():
        head = headline_metric(s)
        bars = []
        for m in ([head] if head else []) + secondary_metrics(s):
            v, ci = s.get(m), s.get(m + CI_SUFFIX)
            if isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v):
                ok = isinstance(ci, list | tuple) and len(ci) == 2 and all(
                    isinstance(x, int | float) and math.isfinite(x) for x in ci)
                bars.append((m, float(v), (float(ci[0]), float(ci[1])) if ok else None))
                if m not in metric_names:
                    metric_names.append(m)
        groups.append((name, bars))

    width = max(6.0, 1.6 * max(1, len(groups)) + 2.0)
    fig = Figure(figsize=(width, 4.5))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    colors = {m: f"C{i % 10}" for i, m in enumerate(metric_names)}
    bar_w = 0.8 / max(1, max((len(b) for _, b in groups), default=1))
    labelled: set[str] = set()
    for gi, (_, bars) in enumerate(groups):
        for bi, (m, v, ci) in enumerate(bars):
            x = gi - 0.4 + bar_w * (bi + 0.5)
            yerr = [[max(0.0, v - ci[0])], [max(0.0, ci[1] - v)]] if ci else None
            ax.bar(x, v, bar_w * 0.95, color=colors[m], yerr=yerr, capsize=3,
                   label=None if m in labelled else m)
            labelled.add(m)
            ax.text(x, (ci[1] if ci else v) + 0.01, f"{v:.2f}", ha="center", va="bottom", fontsize=7)
    ax.set_xticks(list(range(len(groups))))
    ax.set_xticklabels([g for g, _ in groups])
    ax.set_ylim(0.0, 1.1)
    ax.set_ylabel("score (95% bootstrap CI)")
    ax.set_title("Evaluation")
    if labelled:
        ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.tight_layout()
    return _atomic_write(path, lambda tmp: fig.savefig(tmp, dpi=100, format="png"))


def write_report(out_dir: str | os.PathLike, header: Mapping[str, Any],
                 per_benchmark: Mapping[str, Mapping[str, Any]]) -> dict[str, Path]:
    """Write ``report.json``, ``report.md`` and ``report.png`` into ``out_dir`` (created if needed).

    Args:
        out_dir: the evaluation output directory.
        header: run description; ``model``, ``engine``, ``k``, ``temperature``, ``seeds`` and
            ``date`` are listed first in ``report.md``, other keys after them (sorted).
        per_benchmark: benchmark name -> metric dict of
            :func:`trainer.evaluate.metrics.summarize_benchmark` (in table / chart order).

    Returns:
        ``{"json": Path, "md": Path, "png": Path}``.

    Raises:
        OSError: if a file cannot be written (no partial file is left behind).
        TypeError: if ``header`` or a metric holds a value JSON cannot encode.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    data = {"header": _jsonable(dict(header)),
            "benchmarks": {str(k): _jsonable(dict(v)) for k, v in per_benchmark.items()}}
    paths = {
        "json": _write_text(out / "report.json", json.dumps(data, indent=2, allow_nan=False) + "\n"),
        "md": _write_text(out / "report.md", render_markdown(data["header"], data["benchmarks"])),
        "png": _plot(out / "report.png", data["benchmarks"]),
    }
    return paths
