"""Summarise ``copc sweep`` runs over the η_P × η_A grid (``configs/sweeps/eta_grid.yaml``, the
paper's Figure 1 question, issue 46 item 4): does the effect of one channel depend on, or reverse
with, the other?

For each staleness lag, from every finished run's ``summary.json`` and ``config.yaml``:

* the cell table: after-RL held-out accuracy (avg@k), mean ± sd over seeds, and Δ = after − before;
* the advantage channel's effect at each η_P: after(η_P, η_A) − after(η_P, 0), paired by seed (the
  runs of a seed share its warm-start and its before-RL accuracy), with its 95 % t interval and
  the smallest true effect the seeds detect (:func:`critic_arms_report.detectable`);
* the interaction test of the two-way layout with seeds as blocks (a randomized complete block
  design; e.g. Montgomery, *Design and Analysis of Experiments*, ch. 4-5):
  ``y_ijs = μ + β_s + a_i + b_j + (ab)_ij + ε``, ``SS_AB = S Σ_ij (ȳ_ij· − ȳ_i·· − ȳ_·j· + ȳ)²`` on
  ``(I−1)(J−1)`` degrees of freedom against the residual after seeds, factors and cells on
  ``(IJ−1)(S−1)``; ``F = MS_AB / MS_E`` and its p-value (and the main effects' F tests against the
  same ``MS_E``). No interaction (a large p) means the
  data show no dependence of one channel's effect on the other; with 3 seeds only large
  dependences would show, which the detectable column quantifies.

Usage: ``.venv/bin/python scripts/eta_grid_report.py runs/sweeps/eta_grid_lag16 runs/sweeps/eta_grid_lag64
[--out F.md]``.
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import json
import math
import statistics
from pathlib import Path

import yaml


@functools.cache
def _arms_report():
    """``scripts/critic_arms_report.py`` as a module (its statistics and metrics readers), loaded once."""
    spec = importlib.util.spec_from_file_location("critic_arms_report",
                                                  Path(__file__).with_name("critic_arms_report.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _cell_key(run: Path) -> tuple[int, float, float, int]:
    """``(lag, eta_p, eta_a, seed)`` of a run directory, from its ``config.yaml``.

    Raises:
        KeyError: the config has no explicit ``eta_p`` / ``eta_a`` (or lag, seed).
    """
    cfg = yaml.safe_load((run / "config.yaml").read_text())
    alg = cfg.get("algorithm") or {}
    return (int(cfg["train"]["staleness"]["lag"]), float(alg["policy_loss_settings"]["eta_p"]),
            float(alg["estimator_settings"]["eta_a"]), int(cfg["train"]["seed"]))


def runs(sweeps: list[Path]) -> tuple[list[dict], list[str]]:
    """One record per finished run of the sweep directories: ``eta_p``, ``eta_a``, ``lag``,
    ``seed``, ``before`` / ``after`` (held-out accuracy, avg@k); and one line per run left out
    (no evaluation after RL, a non-finite accuracy such as an evaluation whose every episode failed,
    or a ``config.yaml`` without explicit ``eta_p`` / ``eta_a``), so none is dropped silently.

    Raises:
        ValueError: two runs of the directories share (lag, eta_p, eta_a, seed), naming both.
    """
    out, skipped, seen = [], [], {}
    for sweep in sweeps:
        for summary in sorted(sweep.glob("cells/*/seed*/summary.json")):
            s = json.loads(summary.read_text())
            try:
                lag, eta_p, eta_a, seed = _cell_key(summary.parent)
                rec = {"eta_p": eta_p, "eta_a": eta_a, "lag": lag, "seed": seed,
                       "before": float(s["eval_before"]["accuracy"]),
                       "after": float(s["eval_after"]["accuracy"])}
            except (KeyError, TypeError) as e:
                skipped.append(f"{summary.parent}: no {e} in its config.yaml / summary.json")
                continue
            if not (math.isfinite(rec["before"]) and math.isfinite(rec["after"])):
                skipped.append(f"{summary.parent}: accuracy before {rec['before']}, after {rec['after']}")
                continue
            key = (rec["lag"], rec["eta_p"], rec["eta_a"], rec["seed"])
            if key in seen:
                raise ValueError(f"eta_grid_report: {seen[key]} and {summary.parent} are the same run "
                                 f"(lag, eta_p, eta_a, seed) = {key}")
            seen[key] = summary.parent
            out.append(rec)
    return out, skipped


#: What the channels saw (``scripts/critic_arms_report.py``'s keys), means over a run's last 16 steps.
CHANNEL_KEYS = ("diag/abs_log_ratio", "diag/policy_masked_frac", "advantage/clipped_frac",
                "critic/explained_variance")


def channel_table(sweeps: list[Path], last: int = 16) -> str:
    """Markdown: per lag and (η_P, η_A) cell, the median over its runs of each run's mean of
    :data:`CHANNEL_KEYS` over its last ``last`` RL steps (how far π_old strayed from µ, the share
    of tokens the policy mask dropped and the advantage interval clipped, the critic's explained
    variance). A run without ``metrics.jsonl`` is not counted."""
    arms = _arms_report()
    cells: dict[tuple, list[dict]] = {}
    for sweep in sweeps:
        for metrics in sorted(sweep.glob("cells/*/seed*/metrics.jsonl")):
            try:
                key = _cell_key(metrics.parent)[:3]
            except (KeyError, TypeError):
                continue
            cells.setdefault(key, []).append(arms._late_means(arms.rl_steps(metrics), CHANNEL_KEYS, last))
    lines = [f"What the channels saw: means over each run's last {last} RL steps, median over seeds:", "",
             "| lag | η_P | η_A | " + " | ".join(f"`{k}`" for k in CHANNEL_KEYS) + " |",
             "|---|---|---|" + "---|" * len(CHANNEL_KEYS)]
    for (lag, p, a), rows in sorted(cells.items()):
        vals = [arms._median([r[k] for r in rows]) for k in CHANNEL_KEYS]
        lines.append(f"| {lag} | {p:g} | {a:g} | " + " | ".join(f"{v:.3g}" for v in vals) + " |")
    return "\n".join(lines) + "\n"


def eta_a_effects(recs: list[dict]) -> list[dict]:
    """Per lag, η_P and η_A > 0: the per-seed differences after(η_P, η_A) − after(η_P, 0), with
    n, mean, 95 % t interval, sd and the detectable effect (paired t, α 0.05, power 0.8)."""
    arms = _arms_report()
    out = []
    for lag in sorted({r["lag"] for r in recs}):
        by = {(r["eta_p"], r["eta_a"], r["seed"]): r["after"] for r in recs if r["lag"] == lag}
        for p in sorted({k[0] for k in by}):
            for a in sorted({k[1] for k in by if k[0] == p and k[1] > 0}):
                d = [by[(p, a, s)] - by[(p, 0.0, s)] for (pp, aa, s) in by
                     if (pp, aa) == (p, a) and (p, 0.0, s) in by]
                if len(d) < 2:
                    continue
                m, lo, hi, sd = arms.t_interval(d)
                out.append({"lag": lag, "eta_p": p, "eta_a": a, "n": len(d), "mean": m, "lo": lo, "hi": hi,
                            "sd": sd, "mde": arms.detectable(sd, len(d))})
    return out


def interaction_test(cells: dict[tuple[float, float, int], float]) -> dict:
    """The η_P × η_A interaction F test of one lag's complete grid, seeds as blocks (module
    docstring). ``cells``: ``(eta_p, eta_a, seed) -> after``.

    Returns:
        ``{"F", "p", "df_ab", "df_err", "ss_ab", "ss_err", "ss_a", "ss_b", "ss_seed"}`` for the
        interaction, and the main effects' ``F_a`` / ``p_a`` (η_P, ``df_a`` = I − 1) and ``F_b`` /
        ``p_b`` (η_A, ``df_b`` = J − 1), each against the same residual mean square.

    Raises:
        ValueError: the grid is incomplete (a seed misses a cell), or has fewer than 2 levels of a
            factor or fewer than 2 seeds, or an accuracy is not finite.
    """
    from scipy.stats import f as f_dist

    if not all(math.isfinite(v) for v in cells.values()):
        raise ValueError("interaction_test: a run's accuracy is not finite")
    ps, as_, ss = (sorted({k[i] for k in cells}) for i in range(3))
    I, J, S = len(ps), len(as_), len(ss)
    if min(I, J, S) < 2 or len(cells) != I * J * S:
        raise ValueError(f"interaction_test: need a complete grid of >= 2 x 2 cells and >= 2 seeds, "
                         f"got {I} eta_p x {J} eta_a x {S} seeds with {len(cells)} runs")
    y = {k: float(v) for k, v in cells.items()}
    grand = statistics.mean(y.values())
    cell = {(p, a): statistics.mean(y[(p, a, s)] for s in ss) for p in ps for a in as_}
    pm = {p: statistics.mean(cell[(p, a)] for a in as_) for p in ps}
    am = {a: statistics.mean(cell[(p, a)] for p in ps) for a in as_}
    sm = {s: statistics.mean(y[(p, a, s)] for p in ps for a in as_) for s in ss}
    ss_total = sum((v - grand) ** 2 for v in y.values())
    ss_a = J * S * sum((v - grand) ** 2 for v in pm.values())
    ss_b = I * S * sum((v - grand) ** 2 for v in am.values())
    ss_seed = I * J * sum((v - grand) ** 2 for v in sm.values())
    ss_ab = S * sum((cell[(p, a)] - pm[p] - am[a] + grand) ** 2 for p in ps for a in as_)
    ss_err = max(ss_total - ss_a - ss_b - ss_seed - ss_ab, 0.0)
    df_ab, df_err = (I - 1) * (J - 1), (I * J - 1) * (S - 1)
    tol = 1e-12 * max(ss_total, 1e-300)  # rounding: a sum of squares below it is 0

    def f_ratio(ss: float, df: int) -> float:
        if ss <= tol:
            return 0.0
        return math.inf if ss_err <= tol else (ss / df) / (ss_err / df_err)  # inf: an exact fit

    out = {"df_ab": df_ab, "df_err": df_err, "df_a": I - 1, "df_b": J - 1, "ss_ab": ss_ab, "ss_err": ss_err,
           "ss_a": ss_a, "ss_b": ss_b, "ss_seed": ss_seed}
    for name, ss, df in (("", ss_ab, df_ab), ("_a", ss_a, I - 1), ("_b", ss_b, J - 1)):
        F = f_ratio(ss, df)
        out[f"F{name}"], out[f"p{name}"] = F, float(f_dist.sf(F, df, df_err))
    return out


def _fmt(xs: list[float]) -> str:
    return f"{statistics.mean(xs):.3f}" + (f" ± {statistics.stdev(xs):.3f}" if len(xs) > 1 else "")


def cell_table(recs: list[dict], lag: int) -> str:
    """Markdown: rows η_P, columns η_A, after-RL mean ± sd (n seeds) and the mean Δ in brackets."""
    rs = [r for r in recs if r["lag"] == lag]
    ps, as_ = sorted({r["eta_p"] for r in rs}), sorted({r["eta_a"] for r in rs})
    lines = [f"Lag {lag}: after-RL accuracy, mean ± sd over seeds [mean Δ = after − before]; the last "
             "column and row: the means over the other factor (every seed):", "",
             "| η_P \\ η_A | " + " | ".join(f"{a:g}" for a in as_) + " | all η_A |",
             "|---|" + "---|" * (len(as_) + 1)]
    for p in ps:
        row = []
        for a in as_:
            c = [r for r in rs if (r["eta_p"], r["eta_a"]) == (p, a)]
            delta = statistics.mean(r["after"] - r["before"] for r in c) if c else 0.0
            row.append(f"{_fmt([r['after'] for r in c])} [{delta:+.3f}]" if c else "–")
        row_mean = statistics.mean(r["after"] for r in rs if r["eta_p"] == p)
        lines.append(f"| {p:g} | " + " | ".join(row) + f" | {row_mean:.3f} |")
    cols = [statistics.mean(r["after"] for r in rs if r["eta_a"] == a) for a in as_]
    grand = statistics.mean(r["after"] for r in rs)
    lines.append("| all η_P | " + " | ".join(f"{c:.3f}" for c in cols) + f" | {grand:.3f} |")
    return "\n".join(lines) + "\n"


def report(recs: list[dict]) -> str:
    """The whole markdown report: per lag the cell table, the η_A effects and the interaction test."""
    parts = []
    effects = eta_a_effects(recs)
    for lag in sorted({r["lag"] for r in recs}):
        parts.append(cell_table(recs, lag))
        lines = [f"Lag {lag}: effect of the advantage channel at each η_P, after(η_P, η_A) − after(η_P, 0) "
                 "paired by seed; the last column is the smallest true effect these seeds detect "
                 "(paired t, α = 0.05 two-sided, power 0.8):", "",
                 "| η_P | η_A | seeds | mean | 95 % interval | detectable |", "|---|---|---|---|---|---|"]
        lines += [f"| {e['eta_p']:g} | {e['eta_a']:g} | {e['n']} | {e['mean']:+.3f} | "
                  f"[{e['lo']:+.3f}, {e['hi']:+.3f}] | {e['mde']:.3f} |" for e in effects if e["lag"] == lag]
        parts.append("\n".join(lines) + "\n")
        try:
            t = interaction_test({(r["eta_p"], r["eta_a"], r["seed"]): r["after"]
                                  for r in recs if r["lag"] == lag})
            parts.append(f"Lag {lag}: η_P × η_A interaction (seeds as blocks): "
                         f"F({t['df_ab']}, {t['df_err']}) = {t['F']:.2f}, p = {t['p']:.3f}; sums of "
                         f"squares: η_P {t['ss_a']:.4f}, η_A {t['ss_b']:.4f}, interaction "
                         f"{t['ss_ab']:.4f}, seeds {t['ss_seed']:.4f}, residual {t['ss_err']:.4f}. "
                         f"Main effects: η_P F({t['df_a']}, {t['df_err']}) = {t['F_a']:.2f}, "
                         f"p = {t['p_a']:.3f}; η_A F({t['df_b']}, {t['df_err']}) = {t['F_b']:.2f}, "
                         f"p = {t['p_b']:.3f}.\n")
        except ValueError as e:
            parts.append(f"Lag {lag}: no interaction test ({e}).\n")
    return "\n".join(parts)


def main() -> None:
    """Print (and with ``--out`` write) the report of the sweep directories."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("sweeps", type=Path, nargs="+")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    recs, skipped = runs(args.sweeps)
    text = report(recs) + "\n" + channel_table(args.sweeps)
    if skipped:
        text += "\nRuns left out:\n" + "".join(f"- {x}\n" for x in skipped)
    print(text)
    if args.out is not None:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
