"""End-of-run PNG plots from the per-step metrics records (``metrics.jsonl``).

``make_plots`` writes, when their metrics are present (a plot whose keys are all
absent is skipped):

===================== ===================================================================
file                  content
===================== ===================================================================
reward_accuracy.png   reward (``.../reward_mean``, ``.../reward``) and accuracy (``.../accuracy``,
                      ``.../em``, ``.../avg@k``) vs step, one line per key
reward_by_version.png reward and accuracy by policy version (beside the per-step curves above): x =
                      policy version, y = the mean over all trained episodes that version
                      generated, pooled over steps weighted by episode counts
                      (``rollout/*_by_version/v<k>``, :mod:`.by_version`), with any held-out curve
                      (``eval/*`` reward / accuracy keys) against ``eval/policy_version``; a third
                      panel: episodes per generating version
staleness.png         histogram of rollout staleness (policy versions behind) over the run:
                      summed per-step counts from ``staleness/hist`` (list, index = staleness)
                      or ``staleness/hist_<k>`` keys; else the distribution of the per-step
                      ``staleness/mean`` and ``staleness/max`` values
masked_fraction.png   fraction of tokens masked by each channel vs step: ``actor/dis_masked_frac``,
                      ``advantage/clipped_frac`` and any other ``*masked_frac`` / ``*clipped_frac``
ratio.png             importance-ratio statistics vs step: ``actor/ratio_mean``, ``_max``, ``_min``
value_loss.png        ``critic/value_loss`` vs step
tool_calls.png        tool use vs step: executed tool calls per episode (``rollout/tool_calls``,
                      ``eval/mean_tool_calls``), share of episodes with a tool call
                      (``eval/tool_call_rate``) and of turns rejected as invalid
                      (``rollout/invalid_action_rate``, ``eval/invalid_action_rate``)
rollout_time.png      where rollout time goes vs step: seconds summed over the step's episodes in
                      generation, in the environment (tools, sandbox, retriever, remote env) and
                      the rest (``time/rollout_llm_s``, ``time/rollout_env_s``,
                      ``time/rollout_other_s``), stacked
filtered_groups.png   dynamic sampling (``train.filter_groups``) vs step: prompt groups dropped because
                      every episode got one reward (``rollout/filtered_groups_step``), beside the
                      groups trained (``rollout/groups_trained``, when logged)
diagnostics.png       off-policy diagnostics vs step, one panel per group present:
                      (1) fraction masked/clipped below and above each channel's interval
                      (``diag/policy_masked_{low,high}_frac``, else ``actor/dis_masked_*``;
                      ``advantage/clipped_{low,high}_frac``); (2) Kish ESS/N per channel
                      (``diag/policy_ess_frac``, ``diag/advantage_ess_frac``); (3) mean |log ρ|
                      per staleness level (``diag/abs_log_ratio_s<k>``, one curve per k);
                      (4) critic value bias, |bias| and drift (``critic/value_bias*``, against µ's
                      returns); (5) the critic against π: ``value/policy_value_gap`` and
                      ``value/b_hat`` (:mod:`copc.value_probes`), each step's and pooled over
                      ``train.value_probes.window_steps`` (``value/pooled_*``)
===================== ===================================================================

Uses matplotlib's object API with the Agg canvas (no pyplot, so no global figure
state and no display needed). Non-finite values are drawn as gaps.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import matplotlib
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from .by_version import eval_by_version, pooled_from_metrics
from .metrics_log import is_metric_number, metric_series

_REWARD_RE = re.compile(r"(^|/)reward(_mean)?$")
_ACC_RE = re.compile(r"(^|/)(accuracy|em|avg@\d+)$")
_MASK_RE = re.compile(r"(masked_frac|clipped_frac)$")
_HIST_KEY_RE = re.compile(r"^staleness/hist_(\d+)$")
MASK_KEYS = ("actor/dis_masked_frac", "advantage/clipped_frac")
RATIO_KEYS = ("actor/ratio_mean", "actor/ratio_max", "actor/ratio_min")
_ABS_LOG_RATIO_RE = re.compile(r"^diag/abs_log_ratio_s(\d+)$")
POLICY_MASK_KEYS = ("diag/policy_masked_low_frac", "diag/policy_masked_high_frac")
POLICY_MASK_FALLBACK = ("actor/dis_masked_low_frac", "actor/dis_masked_high_frac")
ADVANTAGE_CLIP_KEYS = ("advantage/clipped_low_frac", "advantage/clipped_high_frac")
ESS_KEYS = ("diag/policy_ess_frac", "diag/advantage_ess_frac")
VALUE_BIAS_KEYS = ("critic/value_bias", "critic/value_bias_abs", "critic/value_bias_drift")
VALUE_PI_KEYS = ("value/policy_value_gap", "value/b_hat", "value/pooled_policy_value_gap",
                 "value/pooled_b_hat")


#: ``tool_calls.png`` curves, in legend order.
TOOL_KEYS = ("rollout/tool_calls", "eval/mean_tool_calls", "eval/tool_call_rate",
             "rollout/invalid_action_rate", "eval/invalid_action_rate")

#: ``filtered_groups.png`` curves.
FILTER_KEYS = ("rollout/filtered_groups_step", "rollout/groups_trained")

#: ``rollout_time.png`` areas, bottom to top.
TIME_KEYS = ("time/rollout_llm_s", "time/rollout_env_s", "time/rollout_other_s")


def _keys(metrics: list[dict], pred: Callable[[str], bool]) -> list[str]:
    """Keys (first-seen order) that satisfy ``pred`` and hold a number in at least one record."""
    seen: dict[str, None] = {}
    for rec in metrics:
        for k, v in rec.items():
            if k not in seen and k not in ("step", "time") and pred(k) and is_metric_number(v):
                seen[k] = None
    return list(seen)


def _save(fig: Figure, path: Path) -> Path:
    FigureCanvasAgg(fig)
    fig.tight_layout()
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}.png")
    fig.savefig(tmp, dpi=100)
    os.replace(tmp, path)
    return path


def _line_plot(ax, metrics: list[dict], keys: list[str], ylabel: str) -> None:
    for k in keys:
        xs, ys = metric_series(metrics, k)
        sparse = len(xs) < len(metrics) / 2  # e.g. eval metrics logged every N steps
        ax.plot(xs, ys, marker="o" if sparse or len(xs) < 30 else None, markersize=3, label=k)
    ax.set_xlabel("step")
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)


def _plot_reward_accuracy(metrics: list[dict], path: Path) -> Path | None:
    rew = _keys(metrics, lambda k: bool(_REWARD_RE.search(k)))
    acc = _keys(metrics, lambda k: bool(_ACC_RE.search(k)))
    panels = [(keys, label) for keys, label in ((rew, "reward"), (acc, "accuracy")) if keys]
    if not panels:
        return None
    fig = Figure(figsize=(7, 3.2 * len(panels)))
    for i, (keys, label) in enumerate(panels):
        ax = fig.add_subplot(len(panels), 1, i + 1)
        _line_plot(ax, metrics, keys, label)
    fig.axes[0].set_title("reward and accuracy vs step")
    return _save(fig, path)


def by_version_figure(metrics: list[dict]) -> Figure | None:
    """The figure of ``reward_by_version.png`` (module docstring), unsaved.

    Panels: reward, accuracy (each: the training episodes pooled by generating version,
    :func:`~.by_version.pooled_from_metrics`, and the matching ``eval/*`` keys against
    ``eval/policy_version``, :func:`~.by_version.eval_by_version`), episodes per version (bars).
    Panels without data are left out; None when the run logged neither kind of key.
    """
    pooled = pooled_from_metrics(metrics)
    vers = sorted(pooled)
    evals = {label: eval_by_version(metrics, _keys(metrics, lambda k, r=rx: k.startswith("eval/")
                                                   and bool(r.search(k))))
             for label, rx in (("reward", _REWARD_RE), ("accuracy", _ACC_RE))}
    panels = [label for label in ("reward", "accuracy") if vers or evals[label]]
    if not panels:
        return None
    rows = len(panels) + bool(vers)
    fig = Figure(figsize=(7, 3.2 * rows))
    axes = [fig.add_subplot(rows, 1, 1)]
    axes += [fig.add_subplot(rows, 1, i + 1, sharex=axes[0]) for i in range(1, rows)]
    for ax, label in zip(axes, panels, strict=False):
        if vers:
            ax.plot(vers, [getattr(pooled[v], label) for v in vers], marker="o", markersize=3,
                    label=f"rollout {label} (trained episodes, by generating version)")
        for key, (xs, ys) in evals[label].items():
            ax.plot(xs, ys, marker="s", markersize=4, linestyle="--", label=f"{key} (by eval/policy_version)")
        ax.set_ylabel(label)
        ax.legend(fontsize=8)
    if vers:
        axes[-1].bar(vers, [pooled[v].episodes for v in vers], color="tab:gray")
        axes[-1].set_ylabel("episodes trained")
    for ax in axes:
        ax.set_xlabel("policy version")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
    if vers:
        axes[-1].set_xlabel("generating policy version")
    fig.axes[0].set_title("reward and accuracy by policy version (pooled over steps)")
    return fig


def _staleness_counts(metrics: list[dict]) -> list[float] | None:
    """Summed per-staleness counts from ``staleness/hist`` lists or ``staleness/hist_<k>`` keys."""
    counts: list[float] = []

    def add(k: int, c: Any) -> None:
        if is_metric_number(c) and math.isfinite(c):
            counts.extend([0.0] * (k + 1 - len(counts)))
            counts[k] += float(c)

    found = False
    for rec in metrics:
        hist = rec.get("staleness/hist")
        if isinstance(hist, list):
            found = True
            for k, c in enumerate(hist):
                add(k, c)
        for key, c in rec.items():
            m = _HIST_KEY_RE.match(key)
            if m:
                found = True
                add(int(m.group(1)), c)
    return counts if found else None


def _plot_staleness(metrics: list[dict], path: Path) -> Path | None:
    counts = _staleness_counts(metrics)
    fig = Figure(figsize=(7, 4))
    ax = fig.add_subplot(1, 1, 1)
    if counts is not None:
        ax.bar(range(len(counts)), counts, color="tab:blue")
        ax.set_xlabel("staleness (policy versions behind the learner)")
        ax.set_ylabel("count (summed over steps)")
        ax.set_xticks(range(len(counts)))
        ax.set_title("staleness histogram")
    else:
        keys = [k for k in ("staleness/mean", "staleness/max") if _keys(metrics, lambda q, k=k: q == k)]
        if not keys:
            return None
        for k in keys:
            vals = [v for v in metric_series(metrics, k)[1] if math.isfinite(v)]
            top = max(vals, default=0.0)
            bins = [b - 0.5 for b in range(math.floor(top) + 2)]  # unit-wide bins centred on ints
            ax.hist(vals, bins=bins, alpha=0.6, label=k)
        ax.set_xlabel("staleness (policy versions behind the learner)")
        ax.set_ylabel("number of steps")
        ax.set_title("per-step staleness distribution")
        ax.legend(fontsize=8)
    ax.grid(alpha=0.3, axis="y")
    return _save(fig, path)


def _simple(
    metrics: list[dict], path: Path, keys: list[str], ylabel: str, title: str, log_if_positive: bool = False
) -> Path | None:
    if not keys:
        return None
    fig = Figure(figsize=(7, 4))
    ax = fig.add_subplot(1, 1, 1)
    _line_plot(ax, metrics, keys, ylabel)
    if log_if_positive:
        vals = [v for k in keys for v in metric_series(metrics, k)[1] if math.isfinite(v)]
        if vals and min(vals) > 0 and max(vals) / min(vals) > 100:
            ax.set_yscale("log")
    ax.set_title(title)
    return _save(fig, path)


def _present(metrics: list[dict], keys: tuple[str, ...]) -> list[str]:
    return [k for k in keys if _keys(metrics, lambda q, k=k: q == k)]


def _fraction_ylim(metrics: list[dict], keys: list[str]) -> tuple[float, float]:
    """y-range of a panel of fractions: 0 (less a 2 % margin) to the largest value plus 5 %, at
    least 0.001 wide, so that fractions of a few tokens in a thousand are not squashed flat."""
    top = max((v for k in keys for v in metric_series(metrics, k)[1] if math.isfinite(v)), default=0.0)
    top = max(top, 1e-3) * 1.05
    return -0.02 * top, top


def diagnostics_figure(metrics: list[dict]) -> Figure | None:
    """The off-policy diagnostics figure of ``diagnostics.png`` (module docstring), unsaved.

    Args:
        metrics: per-step records (``metrics.jsonl``), each with an int ``step``.

    Returns:
        One panel (axes, in the order of the module docstring) per group present; None if none is.
    """
    policy = _present(metrics, POLICY_MASK_KEYS) or _present(metrics, POLICY_MASK_FALLBACK)
    level_keys = _keys(metrics, lambda q: bool(_ABS_LOG_RATIO_RE.match(q)))
    level_keys.sort(key=lambda k: int(_ABS_LOG_RATIO_RE.match(k).group(1)))
    panels = [
        (policy + _present(metrics, ADVANTAGE_CLIP_KEYS), "fraction of action tokens",
         "masked (policy) / clipped (advantage) below and above the interval"),
        (_present(metrics, ESS_KEYS), "Kish ESS / N", "effective sample size of each channel's weights"),
        (level_keys, "mean |log ρ|  (π_old vs µ)", "mean |log ρ| by staleness level k"),
        (_present(metrics, VALUE_BIAS_KEYS), "V(first action) − return", "critic value bias and drift"),
        (_present(metrics, VALUE_PI_KEYS), "return units",
         "critic vs π: |mean V − Ê_π[R]| and b̂ = Ê_π[R] − Ê_µ[R] (per step; pooled over a window)"),
    ]
    panels = [p for p in panels if p[0]]
    if not panels:
        return None
    fig = Figure(figsize=(7, 3.2 * len(panels)))
    for i, (keys, ylabel, title) in enumerate(panels):
        ax = fig.add_subplot(len(panels), 1, i + 1)
        _line_plot(ax, metrics, keys, ylabel)
        ax.set_title(title, fontsize=10)
        ax.ticklabel_format(axis="y", useOffset=False)
        if any("ess_frac" in k for k in keys):  # ESS/N ∈ [0, 1]
            ax.set_ylim(-0.02, 1.05)
        elif keys is not level_keys and not {"critic/value_bias", *VALUE_PI_KEYS} & set(keys):  # fractions
            ax.set_ylim(*_fraction_ylim(metrics, keys))
        if keys is level_keys and len(keys) > 1:  # staleness levels coloured along a colour map
            cmap = matplotlib.colormaps["viridis"]
            for j, line in enumerate(ax.get_lines()):
                line.set_color(cmap(j / (len(keys) - 1)))
            ax.legend(fontsize=8)
        if {"critic/value_bias", *VALUE_PI_KEYS} & set(keys):
            ax.axhline(0.0, color="gray", linewidth=0.8)
    return fig


def _plot_rollout_time(metrics: list[dict], path: Path) -> Path | None:
    """Stacked areas of :data:`TIME_KEYS` vs step (a missing value counts 0); None if all absent."""
    keys = _present(metrics, TIME_KEYS)
    if not keys:
        return None
    steps = sorted({int(r["step"]) for r in metrics if any(is_metric_number(r.get(k)) for k in keys)})
    by_step = {int(r["step"]): r for r in metrics}

    def val(st: int, k: str) -> float:
        v = by_step[st].get(k)
        return float(v) if is_metric_number(v) and math.isfinite(float(v)) else 0.0

    fig = Figure(figsize=(7, 4))
    ax = fig.add_subplot(1, 1, 1)
    ax.stackplot(steps, *[[val(st, k) for st in steps] for k in keys],
                 labels=[k.removeprefix("time/rollout_").removesuffix("_s") for k in keys], alpha=0.8)
    ax.set_xlabel("step")
    ax.set_ylabel("seconds (sum over the step's episodes)")
    ax.set_title("where rollout time goes: model (llm) vs environment (env) vs other")
    ax.legend(fontsize=8, loc="upper left")
    ax.grid(alpha=0.3)
    return _save(fig, path)


def _plot_figure(fig: Figure | None, path: Path) -> Path | None:
    """Write ``fig`` to ``path``; None (nothing written) for no figure."""
    return None if fig is None else _save(fig, path)


def make_plots(metrics: list[dict], output_dir: str | Path) -> list[Path]:
    """Write the PNG plots of a run (see the module docstring) into ``output_dir``.

    Args:
        metrics: per-step records as written by ``MetricsLogger`` (each with an int
            ``"step"``; other values numbers or lists of numbers). Records lacking a key
            simply contribute no point for it.
        output_dir: directory for the PNGs (created if missing).

    Returns:
        Paths of the PNGs written, in the order of the table above; plots whose keys are
        all absent are skipped (``[]`` for an empty history).

    Raises:
        ValueError: a record is not a dict with an int ``step``.
    """
    for i, rec in enumerate(metrics):
        if (
            not isinstance(rec, dict)
            or isinstance(rec.get("step"), bool)
            or not isinstance(rec.get("step"), int)
        ):
            raise ValueError(f"metrics[{i}] must be a dict with an int 'step', got {rec!r:.100}")
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    masks = [k for k in MASK_KEYS if _keys(metrics, lambda q, k=k: q == k)]
    masks += [k for k in _keys(metrics, lambda q: bool(_MASK_RE.search(q))) if k not in masks]
    ratio = [k for k in RATIO_KEYS if _keys(metrics, lambda q, k=k: q == k)]
    value = _keys(metrics, lambda q: q == "critic/value_loss")
    tools = [k for k in TOOL_KEYS if _keys(metrics, lambda q, k=k: q == k)]
    filtered = [k for k in FILTER_KEYS if _keys(metrics, lambda q, k=k: q == k)]
    written = [
        _plot_reward_accuracy(metrics, out / "reward_accuracy.png"),
        _plot_figure(by_version_figure(metrics), out / "reward_by_version.png"),
        _plot_staleness(metrics, out / "staleness.png"),
        _simple(
            metrics,
            out / "masked_fraction.png",
            masks,
            "fraction of tokens masked",
            "fraction masked by each channel",
        ),
        _simple(
            metrics,
            out / "ratio.png",
            ratio,
            "importance ratio π_θ / π_behavior",
            "importance-ratio statistics",
            log_if_positive=True,
        ),
        _simple(metrics, out / "value_loss.png", value, "value loss", "critic value loss"),
        _simple(metrics, out / "tool_calls.png", tools, "per episode / share",
                "tool calls per episode, tool-call rate, invalid actions"),
        _plot_rollout_time(metrics, out / "rollout_time.png"),
        _simple(metrics, out / "filtered_groups.png", filtered, "prompt groups per step",
                "dynamic sampling: groups dropped (one reward for all episodes) / trained"),
        _plot_figure(diagnostics_figure(metrics), out / "diagnostics.png"),
    ]
    return [p for p in written if p is not None]
