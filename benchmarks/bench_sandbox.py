"""Sandbox latency and throughput vs. plain ``subprocess.run([python, "-c", code])``.

Prints p50/p99 latency (ms) for ``print(1+1)`` and a ~50 ms compute snippet, and calls/s with
2 workers driven by 2 threads, for the bwrap pool (full isolation) and the plain subprocess
reference measured in the same run. Goals (issue 4): p50 <= 5 ms for print(1+1), >= 200
calls/s on 2 cores.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import threading
import time

from environments.sandbox import Sandbox, SandboxConfig

TRIVIAL = "print(1+1)"
COMPUTE = "s = 0\nfor i in range(1_500_000):\n    s += i\nprint(s)"  # ~50 ms on one core


def pct(xs: list[float], q: float) -> float:
    """q-quantile of xs in ms (nearest rank)."""
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] * 1e3


def lat(fn, code: str, n: int) -> list[float]:
    """Wall-clock seconds of n sequential calls (after 3 warm-up calls)."""
    for _ in range(3):
        fn(code)
    out = []
    for _ in range(n):
        t = time.perf_counter()
        fn(code)
        out.append(time.perf_counter() - t)
    return out


def throughput(fn, code: str, seconds: float, threads: int = 2) -> float:
    """Calls per second with ``threads`` concurrent callers."""
    count = [0] * threads
    stop = time.perf_counter() + seconds

    def loop(i: int) -> None:
        while time.perf_counter() < stop:
            fn(code)
            count[i] += 1

    ts = [threading.Thread(target=loop, args=(i,)) for i in range(threads)]
    t0 = time.perf_counter()
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    return sum(count) / (time.perf_counter() - t0)


def main() -> None:
    """Run the benchmark and print the table."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=200, help="calls per latency measurement")
    ap.add_argument("--seconds", type=float, default=3.0, help="throughput duration")
    args = ap.parse_args()

    def plain(code: str) -> None:
        subprocess.run([sys.executable, "-c", code], capture_output=True, check=True)

    with Sandbox(SandboxConfig(workers=2)) as sb:
        def boxed(code: str) -> None:
            r = sb.run(code)
            assert r.ok, r

        rows = []
        for label, code, n in (("print(1+1)", TRIVIAL, args.n), ("compute~50ms", COMPUTE,
                                                                  max(20, args.n // 5))):
            a, b = lat(boxed, code, n), lat(plain, code, max(20, n // 4))
            rows.append((label, pct(a, .5), pct(a, .99), pct(b, .5), pct(b, .99)))
        tp_sb = throughput(boxed, TRIVIAL, args.seconds)
        tp_plain = throughput(plain, TRIVIAL, args.seconds)
    print(f"{'snippet':<15} {'sandbox p50':>12} {'p99':>8} {'subprocess p50':>15} {'p99':>8} "
          f"{'p50 ratio':>10}")
    for label, a50, a99, b50, b99 in rows:
        print(f"{label:<15} {a50:>10.2f}ms {a99:>6.2f}ms {b50:>13.2f}ms {b99:>6.2f}ms "
              f"{b50 / a50:>9.1f}x")
    print(f"throughput print(1+1), 2 workers / 2 threads: sandbox {tp_sb:.0f} calls/s, "
          f"subprocess {tp_plain:.0f} calls/s ({tp_sb / tp_plain:.1f}x)")
    print(f"goals: p50 <= 5 ms -> {'met' if rows[0][1] <= 5 else 'NOT met'}; "
          f">= 200 calls/s -> {'met' if tp_sb >= 200 else 'NOT met'}")


if __name__ == "__main__":
    main()
