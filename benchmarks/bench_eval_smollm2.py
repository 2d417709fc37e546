"""Benchmark: evaluation-runner throughput with SmolLM2-135M-Instruct, 32 concurrent episodes vs
one at a time.

:mod:`bench_eval` with the real model (``--model``, default the pulled ``smollm2-135m-instruct``;
skipped with a note when it is not available), float32, greedy, the first 32 NQ questions with the
BM25 retriever, ``max_new_tokens`` = 64, ``max_turns`` = 2, best of 1 per arm (one-at-a-time is
minutes on 2 cores). Goal (issue 22): >= 2x. Run: ``python benchmarks/bench_eval_smollm2.py``.
"""

from __future__ import annotations

import sys

import bench_eval  # benchmarks/ is on sys.path when a script runs
from real_bench_model import DEFAULT_MODEL

if __name__ == "__main__":
    raise SystemExit(bench_eval.main(sys.argv[1:], model=DEFAULT_MODEL, questions=32, max_new_tokens=64,
                                     repeats=1, goal=2.0))
