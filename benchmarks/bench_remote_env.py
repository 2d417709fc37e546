"""Remote (``copc env serve`` + ``RemoteEnv`` over loopback) vs in-process environment steps.

Prints p50/p99 step latency (ms) of one client for two steps of real environments:

* ``search`` invalid action: the env answers its invalid-action reply without any tool, so the
  step itself costs microseconds and the remote time is the protocol's overhead;
* ``math_tool`` code call: ``<code>print(1+1)</code>`` run in the real bwrap sandbox;

and episodes/s with 64 concurrent sessions (64 client threads, each playing search episodes of a
reset and 4 steps: 3 invalid actions and an answer) against 64 in-process environments driven by
64 threads. Goal (issue 15): remote p50 overhead <= 2 ms per step on loopback.

The in-process search step is a regex miss (~1 us), so the episodes/s ratio measures what the
protocol costs per episode (a WebSocket session opened and closed, five messages, JSON and the
server's thread hand-off), not a slowdown of real episodes, whose steps and model turns take
milliseconds to seconds.
"""

from __future__ import annotations

import argparse
import threading
import time

import environments
from environments.remote.launch import start_env_server

SEARCH_ROW = {"id": "b", "question": "Who wrote Hamlet", "golden_answers": ["Shakespeare"]}
MATH_ROW = {"id": "m", "problem": "What is 1+1?", "answer": "2"}
LONG = {"limits": {"max_turns": 100000, "max_tool_calls": 100000}}


def pct(xs: list[float], q: float) -> float:
    """q-quantile of xs in ms (nearest rank)."""
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] * 1e3


def step_latency(env, row: dict, action: str, n: int) -> list[float]:
    """Seconds of ``n`` sequential steps of ``action`` in one long episode (after 10 warm-up steps)."""
    env.reset(options={"sample": row})
    for _ in range(10):
        env.step(action)
    out = []
    for _ in range(n):
        t = time.perf_counter()
        env.step(action)
        out.append(time.perf_counter() - t)
    return out


def episodes_per_s(make_env, sessions: int, seconds: float) -> float:
    """Search episodes (reset + 3 invalid steps + an answer) per second with ``sessions`` threads."""
    envs = [make_env() for _ in range(sessions)]
    count = [0] * sessions
    stop = time.perf_counter() + seconds

    def loop(i: int) -> None:
        env = envs[i]
        while time.perf_counter() < stop:
            env.reset(options={"sample": SEARCH_ROW})
            for _ in range(3):
                env.step("let me think")
            _, reward, done, _, _ = env.step("<answer>Shakespeare</answer>")
            assert done and reward == 1.0
            count[i] += 1

    threads = [threading.Thread(target=loop, args=(i,)) for i in range(sessions)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    rate = sum(count) / (time.perf_counter() - t0)
    for env in envs:
        env.close()
    return rate


def main() -> None:
    """Run the benchmark and print the table."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=1000, help="steps per latency measurement")
    ap.add_argument("--sessions", type=int, default=64, help="concurrent sessions for episodes/s")
    ap.add_argument("--seconds", type=float, default=5.0, help="throughput duration")
    args = ap.parse_args()
    dead = "http://127.0.0.1:9"  # the invalid-action steps never query a retriever
    search = start_env_server("search", f"retriever_url={dead}", "limits.max_turns=100000",
                              "limits.max_tool_calls=100000",
                              extra_args=("--max-sessions", str(args.sessions)))
    math = start_env_server("math_tool", "limits.max_turns=100000", "limits.max_tool_calls=100000")
    try:
        rows = []
        cases = (("search invalid action", "search", search.url, {"retriever_url": dead}, SEARCH_ROW,
                  "let me think", args.n),
                 ("math_tool code call", "math_tool", math.url, {}, MATH_ROW, "<code>print(1+1)</code>",
                  max(50, args.n // 5)))
        for label, env_id, url, kwargs, row, action, n in cases:
            local = environments.make(env_id, **kwargs, **LONG)
            remote = environments.make("remote", url=url)
            a, b = step_latency(local, row, action, n), step_latency(remote, row, action, n)
            local.close()
            remote.close()
            rows.append((label, pct(a, .5), pct(a, .99), pct(b, .5), pct(b, .99)))
        local_eps = episodes_per_s(lambda: environments.make("search", retriever_url=dead), args.sessions,
                                   args.seconds)
        remote_eps = episodes_per_s(lambda: environments.make("remote", url=search.url), args.sessions,
                                    args.seconds)
    finally:
        search.stop()
        math.stop()
    print(f"{'step':<24} {'in-process p50':>15} {'p99':>8} {'remote p50':>11} {'p99':>8} "
          f"{'p50 overhead':>13} {'p50 ratio':>10}")
    for label, a50, a99, b50, b99 in rows:
        print(f"{label:<24} {a50:>13.3f}ms {a99:>6.3f}ms {b50:>9.3f}ms {b99:>6.3f}ms {b50 - a50:>11.3f}ms "
              f"{b50 / a50:>9.1f}x")
    print(f"episodes/s, {args.sessions} concurrent sessions (reset + 4 steps): in-process {local_eps:.0f}, "
          f"remote {remote_eps:.0f} ({remote_eps / local_eps:.2f}x)")
    overhead = max(r[3] - r[1] for r in rows)
    print(f"goal: remote p50 overhead <= 2 ms per step -> {'met' if overhead <= 2.0 else 'NOT met'} "
          f"({overhead:.3f} ms)")


if __name__ == "__main__":
    main()
