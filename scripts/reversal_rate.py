"""How often the toy model shows the paper's coordination reversal, per N: the figure
``docs/research.md`` quotes.

For every setting (staleness scale × critic noise) and seed it builds the random token tree of
``copc analyze`` (V = 3, H = 4 by default), evaluates the exact (η_P, η_A) gradient-MSE grid
(:func:`copc.coupling.coupling_grid`) at each N (trajectories per update in MSE = bias² + Var/N)
and records whether raising η_A 0.25 → 0.75 has opposite effects at η_P = 0.25 and 0.75
(:func:`copc.coupling.coordination_reversal`), whether it goes the paper's way, and whether the
lowest-MSE cell is in the η_P = 0 row (which masks every token: no update at all). Prints, per N,
those fractions over all instances and the reversal's range over the settings.

Usage: ``.venv/bin/python scripts/reversal_rate.py [--seeds 20] [--n 1,16,256,1024] [--out F.json]``
(about 1 minute on 2 cores with the defaults).
"""

from __future__ import annotations

import argparse
import itertools
import json
from pathlib import Path

import torch

from copc.coupling import DEFAULT_ETAS, coordination_reversal, coupling_grid
from copc.token_tree import TokenTree

STALENESS = (0.1, 0.5, 1.0, 2.0)
CRITIC_NOISE = (0.0, 0.5, 1.0)


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def reversal_rates(seeds: int, ns: list[int], vocab: int, horizon: int) -> dict[str, dict]:
    """``{str(N): {"rate", "paper_direction_rate", "no_update_best_rate", "per_setting":
    {"s=…,noise=…": rate}}}`` (rates are fractions of instances)."""
    counts = {n: {} for n in ns}
    for s, noise in itertools.product(STALENESS, CRITIC_NOISE):
        key = f"s={s:g},noise={noise:g}"
        for seed in range(seeds):
            tree = TokenTree.random(vocab, horizon, generator=torch.Generator().manual_seed(seed),
                                    staleness_scale=s, critic_noise=noise)
            for n in ns:
                grid = coupling_grid(tree, DEFAULT_ETAS, DEFAULT_ETAS, n)
                rev = coordination_reversal(grid)
                c = counts[n].setdefault(key, [0, 0, 0])
                c[0] += int(rev.reversal)
                c[1] += int(rev.reversal and rev.paper_direction)
                c[2] += int(grid.eta_p[int(grid["mse"].argmin()) // len(grid.eta_a)] == 0.0)
    out = {}
    for n in ns:
        per = {k: v[0] / seeds for k, v in counts[n].items()}
        total = len(per) * seeds
        out[str(n)] = {"rate": sum(v[0] for v in counts[n].values()) / total,
                       "paper_direction_rate": sum(v[1] for v in counts[n].values()) / total,
                       "no_update_best_rate": sum(v[2] for v in counts[n].values()) / total,
                       "per_setting": per}
    return out


def main() -> None:
    """Run and print the table (and write ``--out``)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, default=20)
    ap.add_argument("--n", type=_ints, default=[1, 16, 256, 1024], help="comma-separated N values")
    ap.add_argument("--vocab", type=int, default=3)
    ap.add_argument("--horizon", type=int, default=4)
    ap.add_argument("--out", type=Path, default=None, help="also write the rates as JSON here")
    args = ap.parse_args()
    rates = reversal_rates(args.seeds, args.n, args.vocab, args.horizon)
    print(f"V={args.vocab} H={args.horizon}, {args.seeds} seeds × staleness {list(STALENESS)} × "
          f"critic noise {list(CRITIC_NOISE)}")
    print(f"{'N':>6} | {'reversal':>8} | {'paper way':>9} | {'η_P=0 best':>10} | reversal range (settings)")
    for n, r in rates.items():
        lo, hi = min(r["per_setting"].values()), max(r["per_setting"].values())
        print(f"{n:>6} | {r['rate']:>8.2f} | {r['paper_direction_rate']:>9.2f} | "
              f"{r['no_update_best_rate']:>10.2f} | {lo:.2f}–{hi:.2f}")
    if args.out is not None:
        args.out.write_text(json.dumps(rates, indent=1))


if __name__ == "__main__":
    main()
