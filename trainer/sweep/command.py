"""``copc sweep``: a grid of training runs, their results table, Figure-1-style heatmaps and a report.

Usage::

    copc sweep --config BASE --grid key=v1,v2,... [--grid key=...] [--seeds 0,1,2] [--out DIR]
               [--parallel N] [--metric NAME] [--eval-checkpoints] [--x-key K] [--y-key K]
               [--panel-key K] [--dry-run] [key=value ...]
    copc sweep --spec FILE [any of the flags above: they override the file]

One ``copc train`` run per grid cell and seed, in ``OUT/cells/<cell id>/seed<S>``. Every run's
config is validated before the first starts (a bad key or value: exit 2, naming the cell and
the key). Re-running the same command resumes: finished runs are skipped, unfinished ones
continue from their last checkpoint (``--resume``), failed ones are tried again. Outputs in
``OUT``: ``sweep.csv`` (cell × seed), ``sweep_cells.csv`` (mean ± sd per cell),
``heatmap_final.png``, ``heatmap_best.png``, ``curves.png`` and ``report.md``.

Exit status: 0 when every run finished, 1 when one failed (the others still ran), 2 for a bad
spec or config, 130 after Ctrl-C (runs in flight are stopped; re-run to resume).
"""

from __future__ import annotations

import argparse
import shlex
import sys

import yaml

from trainer.errors import ConfigError

from .grid import SweepSpec, format_value, heatmap_axes, load_spec, parse_grid_arg, parse_seeds

EXIT_FAILED_RUNS = 1
EXIT_CONFIG_ERROR = 2
EXIT_INTERRUPTED = 130


def add_arguments(parser: argparse.ArgumentParser, name: str) -> None:
    """Add the options of ``copc sweep`` to ``parser`` and set ``func`` (see the module docstring).

    Raises:
        ValueError: for a group name other than ``sweep``.
    """
    if name != "sweep":
        raise ValueError(f"trainer.sweep.command serves the 'sweep' group, not {name!r}")
    parser.add_argument("--config", default=None, metavar="BASE", help="base YAML config of every run")
    parser.add_argument("--spec", default=None, metavar="FILE",
                        help="sweep spec YAML {config, grid: {key: [values]}, seeds, out, overrides, metric, "
                             "panel_key, ...}; flags given here override it")
    parser.add_argument("--grid", action="append", default=[], metavar="KEY=V1,V2,...",
                        help="a grid axis (repeat for more; the runs are the Cartesian product)")
    parser.add_argument("--seeds", default=None, metavar="S1,S2,...",
                        help="train.seed values per cell (default: the base config's seed)")
    parser.add_argument("--out", default=None, metavar="DIR",
                        help="sweep directory (default runs/sweeps/<name>)")
    parser.add_argument("--parallel", type=int, default=None, metavar="N", help="runs at once (default 1)")
    parser.add_argument("--metric", default=None, metavar="NAME",
                        help="evaluation metric compared (default: accuracy = avg@k; em for search)")
    parser.add_argument("--eval-checkpoints", action="store_true", default=None,
                        help="evaluate every kept checkpoint post hoc (keeps them all); best = max over them")
    parser.add_argument("--x-key", default=None, metavar="KEY", help="heatmap x axis (default: 2nd grid key)")
    parser.add_argument("--y-key", default=None, metavar="KEY", help="heatmap y axis (default: 1st grid key)")
    parser.add_argument("--panel-key", default=None, metavar="KEY",
                        help="one heatmap panel per value of this key (default: 3rd grid key)")
    parser.add_argument("--dry-run", action="store_true", help="validate and print the runs; start nothing")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="overrides applied to every run")
    parser.set_defaults(func=sweep_command)


def spec_from_args(args: argparse.Namespace) -> SweepSpec:
    """The spec file (if any) with the command-line flags merged on top.

    Raises:
        ConfigError: a bad spec file, ``--grid``, ``--seeds`` or ``--parallel`` (named).
    """
    spec = load_spec(args.spec) if args.spec else SweepSpec()
    if args.config:
        spec.config = args.config
    cli_keys: set[str] = set()
    for token in args.grid:
        key, values = parse_grid_arg(token)
        if key in cli_keys:
            raise ConfigError(f"--grid {key}: given twice")
        cli_keys.add(key)
        spec.grid.add(key, values)
    if args.seeds is not None:
        spec.seeds = parse_seeds(args.seeds)
    for k in ("out", "metric", "x_key", "y_key", "panel_key", "parallel", "eval_checkpoints"):
        if getattr(args, k) is not None:
            setattr(spec, k, getattr(args, k))
    spec.overrides = [*spec.overrides, *args.overrides]
    if isinstance(spec.parallel, bool) or not isinstance(spec.parallel, int) or spec.parallel < 1:
        raise ConfigError(f"--parallel={spec.parallel!r}: must be an int >= 1")
    return spec


def command_line(spec: SweepSpec) -> str:
    """A ``copc sweep`` command line equivalent to the resolved ``spec`` (re-run it to resume)."""
    parts = ["copc", "sweep", "--config", str(spec.config)]
    for k, vs in spec.grid.axes.items():
        parts += ["--grid", f"{k}={','.join(format_value(v) for v in vs)}"]
    parts += ["--seeds", ",".join(map(str, spec.seeds or [])), "--out", str(spec.out),
              "--parallel", str(spec.parallel), "--metric", str(spec.metric)]
    parts += ["--eval-checkpoints"] if spec.eval_checkpoints else []
    for flag, v in (("--x-key", spec.x_key), ("--y-key", spec.y_key), ("--panel-key", spec.panel_key)):
        parts += [flag, v] if v else []
    return shlex.join([*parts, *spec.overrides])


def _spec_yaml(spec: SweepSpec) -> str:
    """The resolved spec as a spec file (``copc sweep --spec`` reads it back)."""
    return yaml.safe_dump({"config": spec.config, "grid": dict(spec.grid.axes), "seeds": spec.seeds,
                           "out": spec.out, "overrides": list(spec.overrides), "metric": spec.metric,
                           "x_key": spec.x_key, "y_key": spec.y_key, "panel_key": spec.panel_key,
                           "parallel": spec.parallel, "eval_checkpoints": spec.eval_checkpoints},
                          sort_keys=False)


def sweep_command(args: argparse.Namespace) -> int:
    """``copc sweep``: plan and validate, run what is not done, collect, plot, report.

    Returns:
        0 (every run finished), 1 (a run failed), 2 (bad spec/config), 130 (Ctrl-C).
    """
    from .plan import build_plan

    try:
        spec = spec_from_args(args)
        plan = build_plan(spec)
        heatmap_axes(plan.spec.grid.keys, plan.spec.x_key, plan.spec.y_key, plan.spec.panel_key)
    except ConfigError as e:
        print(f"copc sweep: config error: {e}", file=sys.stderr)
        return EXIT_CONFIG_ERROR
    cmd = command_line(plan.spec)
    if args.dry_run:
        print(f"# {len(plan.runs)} run(s), {sum(r.done() for r in plan.runs)} already done; {cmd}")
        for r in plan.runs:
            print(("# done: " if r.done() else "") + shlex.join(r.train_command(resume=False)))
        return 0
    from ..outputs.lock import lock_output_dir

    try:  # one sweep per --out: the cells' status files, logs and the report live outside their runs
        lock = lock_output_dir(plan.out, "--out")
    except ConfigError as e:
        print(f"copc sweep: config error: {e}", file=sys.stderr)
        return EXIT_CONFIG_ERROR
    try:
        (plan.out / "sweep.yaml").write_text(_spec_yaml(plan.spec))
        from .execute import execute_and_report

        return execute_and_report(plan, cmd)
    finally:
        lock.close()


def main(argv: list[str] | None = None) -> int:
    """``python -m trainer.sweep.command ...`` (same as ``copc sweep ...``)."""
    parser = argparse.ArgumentParser(prog="copc sweep")
    add_arguments(parser, "sweep")
    args = parser.parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    raise SystemExit(main())

