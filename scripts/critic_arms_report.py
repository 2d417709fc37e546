"""Summarise a ``copc sweep`` over ``preset`` × ``train.staleness.lag`` (the critic-arms experiment
of ``docs/research.md``): final held-out accuracy mean ± sd per cell, collapses, and what the
diagnostics show in the collapsing runs (critic drift vs actor).

A run *collapses* when its held-out accuracy after RL is below ``--collapse`` (default 0.1) or
below its own before-RL accuracy by more than 0.2; the diagnostics table lists every run that
ended below its before-RL accuracy at all. For every run the script reads ``metrics.jsonl``
and reports, over the last 5 RL steps, the means of the critic's probes (``critic/value_bias``,
``value/policy_value_gap``, ``value/b_hat``) and of the actor's (``rollout/reward_mean``, the DIS
mask's or PPO clip's fraction of tokens, ``actor/grad_norm``), so a collapse can be attributed.

A second table pairs the arms by seed (every arm of a seed starts from that seed's warm-start):
the per-seed difference of after-RL accuracy, its 95 % t interval, and the smallest true
difference the seed count can detect (paired t-test, α = 0.05, power 0.8).

Usage: ``.venv/bin/python scripts/critic_arms_report.py runs/sweeps/critic_arms [--metric em] [--out F.md]``.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from pathlib import Path

CRITIC_KEYS = ("critic/value_bias", "value/policy_value_gap", "value/b_hat")
ACTOR_KEYS = ("rollout/reward_mean", "actor/dis_masked_frac", "actor/pg_clipfrac", "actor/grad_norm")
#: What the channels saw (the conditions under which the advantage channel can act), late means.
CHANNEL_KEYS = ("diag/abs_log_ratio", "advantage/clipped_frac", "diag/policy_masked_frac",
                "critic/explained_variance", "value/pooled_policy_value_gap", "value/pooled_se_gap")


def rl_steps(metrics: Path) -> list[dict]:
    """The RL steps' rows (``actor/updated``) of a ``metrics.jsonl``, in order."""
    rows = [json.loads(x) for x in metrics.read_text().splitlines() if x.strip()]
    return [r for r in rows if "actor/updated" in r]


def _late_means(steps: list[dict], keys: tuple[str, ...], last: int = 5) -> dict[str, float]:
    """Means over the last ``last`` of the RL ``steps`` (:func:`rl_steps`) of each key
    (``diag/abs_log_ratio``: of the per-staleness ``diag/abs_log_ratio_s<k>`` values the step logged)."""
    steps = steps[-last:]
    out = {}
    for k in keys:
        vals = [float(v) for r in steps for name, v in r.items()
                if (name == k or (k == "diag/abs_log_ratio" and name.startswith(k + "_s")))
                and isinstance(v, int | float) and math.isfinite(v)]
        out[k] = statistics.mean(vals) if vals else math.nan
    return out


def runs(sweep: Path, metric: str = "accuracy") -> list[dict]:
    """One record per finished run: preset, lag, seed, before / after held-out ``metric`` (a key of
    the summary's ``eval_before`` / ``eval_after``: ``accuracy`` = avg@k, ``em`` for search), late
    diagnostics."""
    out = []
    for summary in sorted(sweep.glob("cells/*/seed*/summary.json")):
        run = summary.parent
        s = json.loads(summary.read_text())
        cfg = (run / "config.yaml").read_text()
        preset = next(line.split(":", 1)[1].strip() for line in cfg.splitlines()
                      if line.startswith("preset:"))
        lag = int(run.parent.name.rsplit("lag", 1)[1])
        rec = {"preset": preset, "lag": lag, "seed": int(run.name[4:]),
               "before": s["eval_before"][metric], "after": s["eval_after"][metric]}
        steps = rl_steps(run / "metrics.jsonl")  # read once, for both windows
        rec.update(_late_means(steps, CRITIC_KEYS + ACTOR_KEYS))
        late = _late_means(steps, CHANNEL_KEYS, 16)
        rec.update({f"late16:{k}": v for k, v in late.items()})
        out.append(rec)
    return out


def _median(xs: list[float]) -> float:
    """Median of the finite values (NaN: a key the run's preset does not log)."""
    fin = [x for x in xs if math.isfinite(x)]
    return statistics.median(fin) if fin else math.nan


def _fmt(xs: list[float]) -> str:
    if not xs:
        return "–"
    return f"{statistics.mean(xs):.3f}" + (f" ± {statistics.stdev(xs):.3f}" if len(xs) > 1 else "")


def report(recs: list[dict], collapse: float) -> str:
    """The markdown tables (cells, then every collapsing run's diagnostics)."""
    def collapsed(r: dict) -> bool:
        return r["after"] < collapse or r["after"] < r["before"] - 0.2

    lines = ["| preset | lag | seeds | before RL | after RL | Δ | collapses |",
             "|---|---|---|---|---|---|---|"]
    for preset in dict.fromkeys(r["preset"] for r in recs):
        for lag in sorted({r["lag"] for r in recs}):
            cell = [r for r in recs if r["preset"] == preset and r["lag"] == lag]
            if cell:
                lines.append(f"| {preset} | {lag} | {len(cell)} | {_fmt([r['before'] for r in cell])} | "
                             f"{_fmt([r['after'] for r in cell])} | "
                             f"{_fmt([r['after'] - r['before'] for r in cell])} | "
                             f"{sum(collapsed(r) for r in cell)} |")
    bad = [r for r in recs if r["after"] < r["before"]]
    lines += ["", f"Runs that ended below their own before-RL accuracy (collapses: after < {collapse} or "
              "0.2 below before), last-5-step means of the diagnostics:", ""]
    keys = CRITIC_KEYS + ACTOR_KEYS
    lines += ["| run | after | " + " | ".join(f"`{k}`" for k in keys) + " |",
              "|---|---|" + "---|" * len(keys)]
    for r in bad:
        lines.append(f"| {r['preset']} lag {r['lag']} seed {r['seed']} | {r['after']:.3f} | "
                     + " | ".join(f"{r[k]:.3g}" for k in keys) + " |")
    if not bad:
        lines.append("| (none) |" + " |" * (len(keys) + 1))
    ok = [r for r in recs if r["after"] >= r["before"]]
    if ok:
        lines.append("| median of the other runs | " + f"{statistics.median(r['after'] for r in ok):.3f} | "
                     + " | ".join(f"{_median([r[k] for r in ok]):.3g}" for k in keys) + " |")
    return "\n".join(lines) + "\n"


#: Comparisons of the paired table: (arm, reference).
PAIRS = (("copc", "copc_wo_rc"), ("copc", "ppo_async"), ("copc", "brace"), ("copc_wo_rc", "ppo_async"))


def detectable(sd: float, n: int, alpha: float = 0.05, power: float = 0.8) -> float:
    """Smallest true mean difference a two-sided paired t-test of ``n`` pairs with difference
    standard deviation ``sd`` detects at level ``alpha`` with probability ``power``:
    ``(t_{1-α/2, n-1} + t_{power, n-1}) · sd / √n`` (the usual normal-approximation formula with
    t quantiles; e.g. Cohen 1988, ch. 2). NaN for ``n < 2``."""
    from scipy.stats import t

    if n < 2 or not math.isfinite(sd):
        return math.nan
    return float((t.ppf(1 - alpha / 2, n - 1) + t.ppf(power, n - 1)) * sd / math.sqrt(n))


def t_interval(d: list[float]) -> tuple[float, float, float, float]:
    """Mean, 95 % t interval (lo, hi) and sd of ``d`` (``len(d) >= 2``): ``mean ± t_{0.975, n-1} sd / √n``."""
    from scipy.stats import t

    m, sd = statistics.mean(d), statistics.stdev(d)
    half = float(t.ppf(0.975, len(d) - 1)) * sd / math.sqrt(len(d))
    return m, m - half, m + half, sd


def paired_rows(recs: list[dict]) -> list[dict]:
    """Per lag and :data:`PAIRS` comparison, the per-seed differences of after-RL accuracy (the two
    arms of a seed share its warm-start): n, mean, 95 % t interval, sd, :func:`detectable`."""
    out = []
    for lag in sorted({r["lag"] for r in recs}):
        by = {(r["preset"], r["seed"]): r["after"] for r in recs if r["lag"] == lag}
        for a, b in PAIRS:
            d = [by[(a, s)] - by[(b, s)] for (p, s) in by if p == a and (b, s) in by]
            if len(d) < 2:
                continue
            m, lo, hi, sd = t_interval(d)
            out.append({"lag": lag, "a": a, "b": b, "n": len(d), "mean": m, "lo": lo, "hi": hi,
                        "sd": sd, "mde": detectable(sd, len(d))})
    return out


def paired_report(recs: list[dict]) -> str:
    """The markdown table of :func:`paired_rows` with its power statement."""
    rows = paired_rows(recs)
    lines = ["Paired by seed (the same warm-start), after-RL accuracy of arm − reference; the last "
             "column is the smallest true difference these seeds detect (paired t-test, α = 0.05 "
             "two-sided, power 0.8):", "",
             "| lag | arm − reference | seeds | mean Δ | 95 % interval | sd of Δ | detectable |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['lag']} | {r['a']} − {r['b']} | {r['n']} | {r['mean']:+.3f} | "
                     f"[{r['lo']:+.3f}, {r['hi']:+.3f}] | {r['sd']:.3f} | {r['mde']:.3f} |")
    return "\n".join(lines) + "\n"


def channel_report(recs: list[dict]) -> str:
    """Per preset and lag, the medians over seeds of :data:`CHANNEL_KEYS` over each run's last 16
    steps: how far π_old/µ strayed (mean |log ρ|), how often the advantage channel clipped and the
    policy channel masked, the critic's explained variance, and the pooled π-referenced gap."""
    lines = ["What the channels saw, means over each run's last 16 RL steps, median over seeds (an "
             "all-0 batch makes the explained variance of one step huge and negative):", "",
             "| preset | lag | " + " | ".join(f"`{k}`" for k in CHANNEL_KEYS) + " |",
             "|---|---|" + "---|" * len(CHANNEL_KEYS)]
    for preset in dict.fromkeys(r["preset"] for r in recs):
        for lag in sorted({r["lag"] for r in recs}):
            cell = [r for r in recs if r["preset"] == preset and r["lag"] == lag]
            if cell:
                vals = [_median([r[f"late16:{k}"] for r in cell]) for k in CHANNEL_KEYS]
                lines.append(f"| {preset} | {lag} | " + " | ".join(f"{v:.3g}" for v in vals) + " |")
    return "\n".join(lines) + "\n"


def main() -> None:
    """Print (and with ``--out`` write) the report of the sweep directory."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("sweep", type=Path)
    ap.add_argument("--collapse", type=float, default=0.1)
    ap.add_argument("--metric", default="accuracy", help="held-out metric: accuracy (avg@k) or em (search)")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    recs = runs(args.sweep, args.metric)
    text = report(recs, args.collapse) + "\n" + paired_report(recs) + "\n" + channel_report(recs)
    print(text)
    if args.out is not None:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
