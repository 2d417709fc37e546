"""Run every ``benchmarks/bench_*.py`` script in turn (the ``make bench`` target).

Each script prints its own table with ratios against a reference measured in the
same run. Exit status is non-zero if any script fails.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path


def main() -> int:
    """Run all benchmark scripts found next to this file; return the worst exit code."""
    here = Path(__file__).resolve().parent
    worst = 0
    for script in sorted(here.glob("bench_*.py")):
        print(f"\n=== {script.name} ===", flush=True)
        rc = subprocess.call([sys.executable, str(script)], cwd=here.parent)
        worst = max(worst, rc)
    return worst


if __name__ == "__main__":
    raise SystemExit(main())
