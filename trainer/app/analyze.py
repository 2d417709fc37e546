"""``copc analyze``: exact Propositions 2–3 / Corollary 1 over an (η_P, η_A) grid on a random token tree.

Builds :meth:`copc.token_tree.TokenTree.random` from the options, evaluates
:func:`copc.coupling.coupling_grid` and writes to ``--out``:

* ``analysis.json``: ``{"config": {...options...}, "grid": CouplingGrid.to_dict(),
  "reversal": Reversal fields or null, "reversals": [...every reversal on the grid...]}``;
  grid metrics are nested lists indexed ``[i_eta_p][i_eta_a]``;
* ``mse_heatmap.png``: three panels (bias², variance/N, MSE), cell values printed.

It prints the MSE table and whether a coordination reversal appeared (the sign of raising
η_A from 0.25 to 0.75 differs between η_P = 0.25 and η_P = 0.75; spec "What the paper proves").

Example: ``copc analyze --vocab 3 --horizon 4 --staleness-scale 0.5 --critic-noise 0.2 --n 4 --out out/``.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from pathlib import Path

import torch

from copc.coupling import (
    DEFAULT_ETAS,
    CouplingGrid,
    Reversal,
    coordination_reversal,
    coupling_grid,
    find_reversals,
)
from copc.margins import EPS_HIGH, EPS_LOW
from copc.token_tree import TokenTree

#: Tree options forwarded to :meth:`TokenTree.random` (argparse dest → keyword).
_TREE_OPTIONS = ("staleness_scale", "critic_noise", "critic_lag", "logit_scale", "token_reward_scale",
                 "gamma", "lam", "eps_low", "eps_high")


def _etas(text: str) -> tuple[float, ...]:
    """Parse a comma-separated list of η values (argparse type)."""
    try:
        return tuple(float(x) for x in text.split(",") if x.strip())
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from e


def add_arguments(parser: argparse.ArgumentParser, name: str) -> None:
    """Add the ``copc analyze`` options to ``parser`` and set ``func``.

    Args:
        parser: the group's sub-parser (from :func:`trainer.cli.build_parser`).
        name: ``"analyze"``.

    Raises:
        ValueError: for another ``name``.
    """
    if name != "analyze":
        raise ValueError(f"trainer.app.analyze serves the 'analyze' group, not {name!r}")
    a = parser.add_argument
    a("--vocab", type=int, default=3, help="vocabulary size V >= 2 (default 3)")
    a("--horizon", type=int, default=4, help="tokens per trajectory H >= 1, V**H <= 65536 (default 4)")
    a("--staleness-scale", type=float, default=0.5,
      help="std of the logit perturbation µ = π + s·N(0,1), a proxy for staleness (default 0.5)")
    a("--critic-noise", type=float, default=0.1, help="std of the critic error V̂ − V (default 0.1)")
    a("--critic-lag", type=float, default=0.0,
      help="critic mixes V^π and the stale V^µ: V̂ = (1−c)V^π + c·V^µ + noise (default 0)")
    a("--logit-scale", type=float, default=1.0, help="std of π's logits (default 1)")
    a("--token-reward-scale", type=float, default=0.0,
      help="std of extra per-token rewards (default 0: outcome reward only)")
    a("--gamma", type=float, default=1.0, help="discount γ (default 1, as the paper)")
    a("--lam", type=float, default=1.0, help="λ (default 1, as the paper)")
    a("--eps-low", type=float, default=EPS_LOW, help=f"base margin ε_ℓ (default {EPS_LOW})")
    a("--eps-high", type=float, default=EPS_HIGH, help=f"base margin ε_h (default {EPS_HIGH})")
    a("--eta-p", type=_etas, default=DEFAULT_ETAS, help="comma-separated η_P grid (default 0,.25,.5,.75,1)")
    a("--eta-a", type=_etas, default=DEFAULT_ETAS, help="comma-separated η_A grid (default 0,.25,.5,.75,1)")
    a("--n", type=int, default=1, help="trajectories per update N in MSE = bias² + Var/N (default 1)")
    a("--seed", type=int, default=0, help="seed of the random tree (default 0)")
    a("--out", required=True, metavar="DIR", help="output directory (created)")
    parser.set_defaults(func=analyze_command)


def run_analysis(args: argparse.Namespace) -> tuple[dict[str, object], CouplingGrid]:
    """Build the tree and evaluate the grid (no I/O).

    Returns:
        ``(payload, grid)``: the ``analysis.json`` content and the :class:`CouplingGrid`.

    Raises:
        ValueError: on an invalid option (the message names it).
    """
    g = torch.Generator().manual_seed(args.seed)
    tree = TokenTree.random(args.vocab, args.horizon, generator=g,
                            **{k: getattr(args, k) for k in _TREE_OPTIONS})
    grid = coupling_grid(tree, args.eta_p, args.eta_a, args.n)
    try:
        rev: Reversal | None = coordination_reversal(grid)
    except ValueError:  # the paper's cells (0.25, 0.75) are not on this grid
        rev = None
    config = {k: getattr(args, k) for k in ("vocab", "horizon", "seed", "n", *_TREE_OPTIONS)}
    config.update(eta_p=list(grid.eta_p), eta_a=list(grid.eta_a))
    return {"config": config, "grid": grid.to_dict(), "reversal": None if rev is None else asdict(rev),
            "reversals": [asdict(r) for r in find_reversals(grid)]}, grid


def _heatmap(grid: CouplingGrid, path: Path) -> None:
    """Write ``mse_heatmap.png``: bias², variance/N and MSE panels with printed cell values."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(15, 4.6))
    FigureCanvasAgg(fig)
    panels = (("bias2", "bias² ‖g − g*‖²"), ("variance_over_n", f"variance / N (N = {grid.n})"),
              ("mse", "MSE = bias² + variance/N"))
    for k, (key, title) in enumerate(panels):
        ax = fig.add_subplot(1, 3, k + 1)
        m = grid[key].numpy()
        im = ax.imshow(m, origin="lower", cmap="viridis", aspect="auto")
        hi = float(m.max()) if m.size else 0.0
        for i in range(m.shape[0]):
            for j in range(m.shape[1]):
                ax.text(j, i, f"{m[i, j]:.3g}", ha="center", va="center", fontsize=8,
                        color="black" if m[i, j] > 0.6 * hi else "white")
        ax.set_xticks(range(len(grid.eta_a)), [f"{v:g}" for v in grid.eta_a])
        ax.set_yticks(range(len(grid.eta_p)), [f"{v:g}" for v in grid.eta_p])
        ax.set_xlabel("η_A (advantage channel; larger = weaker)")
        ax.set_ylabel("η_P (policy channel; larger = weaker)")
        ax.set_title(title)
        fig.colorbar(im, ax=ax)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def _print_table(grid: CouplingGrid, rev: dict | None) -> None:
    """Print the MSE grid (rich if installed, else plain text) and the reversal verdict."""
    rows = [[f"{grid.eta_p[i]:g}", *(f"{float(grid['mse'][i, j]):.4g}" for j in range(len(grid.eta_a)))]
            for i in range(len(grid.eta_p))]
    header = ["η_P \\ η_A", *(f"{v:g}" for v in grid.eta_a)]
    try:
        from rich.table import Table

        from ..outputs.progress import report_console
    except ImportError:
        print(f"MSE (N = {grid.n})")
        for r in [header, *rows]:
            print("  ".join(f"{c:>10}" for c in r))
    else:
        table = Table(title=f"gradient MSE = bias² + Var/N (N = {grid.n}), exact")
        for h in header:
            table.add_column(h, justify="right")
        for r in rows:
            table.add_row(*r)
        report_console().print(table)
    if rev is None:
        print("coordination reversal: not checked (η_P/η_A grid lacks 0.25 and 0.75)")
    else:
        verdict = "YES" if rev["reversal"] else "no"
        direction = " (paper's direction)" if rev["paper_direction"] else ""
        print(f"coordination reversal (η_A 0.25→0.75 at η_P 0.25 vs 0.75, N = {grid.n}): "
              f"{verdict}{direction}; ΔMSE = {rev['effect_strong']:+.4g} (strong P), "
              f"{rev['effect_weak']:+.4g} (weak P)")


def analyze_command(args: argparse.Namespace) -> int:
    """Run ``copc analyze``: write ``analysis.json`` and ``mse_heatmap.png`` to ``--out``, print a summary.

    Returns:
        0 on success, 2 on an invalid option (message on stderr).
    """
    try:
        payload, grid = run_analysis(args)
    except (ValueError, TypeError) as e:
        print(f"copc analyze: error: {e}", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "analysis.json").write_text(json.dumps(payload, indent=2) + "\n")
    _heatmap(grid, out / "mse_heatmap.png")
    _print_table(grid, payload["reversal"])
    print(f"wrote {out / 'analysis.json'} and {out / 'mse_heatmap.png'}")
    return 0
