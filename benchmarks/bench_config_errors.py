"""How long ``copc train`` / ``copc eval`` / ``copc sweep`` take to print a config error (issue 42 item 5).

Each command is the real CLI in a fresh interpreter (``python -m trainer.cli ...``) on
``configs/math_tool/cpu_tiny.yaml`` with one bad setting; it must exit with status 2 after its one
line. Printed per command: the median (and min / max) wall time of ``--runs`` runs, beside two
references measured in the same run: a bare interpreter (``python -c pass``) and ``python -c
"import torch, transformers"`` (what validating used to import before printing). Goal: a config
error within ~2 s on a 2-core machine (validation imports no torch: well under a second).
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONFIG = "configs/math_tool/cpu_tiny.yaml"
CLI = [sys.executable, "-m", "trainer.cli"]

#: (label, command, expected exit status)
COMMANDS: list[tuple[str, list[str], int]] = [
    ("python -c pass (reference)", [sys.executable, "-c", "pass"], 0),
    ("import torch, transformers (reference)", [sys.executable, "-c", "import torch, transformers"], 0),
    ("train: bad value", [*CLI, "train", "--config", CONFIG, "train.total_steps=0"], 2),
    ("train: moved algorithm knob", [*CLI, "train", "--config", CONFIG, "algorithm.eta_a=0.3"], 2),
    ("train: learner backend setting", [*CLI, "train", "--config", CONFIG, "learner.backend_settings.nope=1"],
     2),
    ("eval: bad value", [*CLI, "eval", "--config", CONFIG, "train.total_steps=0"], 2),
    ("sweep: bad cell", [*CLI, "sweep", "--config", CONFIG, "--grid", "train.total_steps=0,1",
                         "--out", "/tmp/copc_bench_config_errors", "--dry-run"], 2),
]


def wall_times(cmd: list[str], expected_rc: int, runs: int) -> list[float]:
    """Seconds of ``runs`` runs of ``cmd`` (from the repository root).

    Raises:
        RuntimeError: a run exited with another status than ``expected_rc``.
    """
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
        times.append(time.perf_counter() - t0)
        if proc.returncode != expected_rc:
            raise RuntimeError(f"{cmd}: exit {proc.returncode}, expected {expected_rc}: {proc.stderr[-500:]}")
    return times


def main(argv: list[str] | None = None) -> int:
    """Print the table; returns 0."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5, help="runs per command (default 5)")
    args = parser.parse_args(argv)
    print(f"{'command':42s} {'median s':>9s} {'min s':>7s} {'max s':>7s}  ({args.runs} runs each)")
    for label, cmd, rc in COMMANDS:
        t = wall_times(cmd, rc, args.runs)
        print(f"{label:42s} {statistics.median(t):9.2f} {min(t):7.2f} {max(t):7.2f}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
