"""Benchmark: peak memory of the supervised warm-start on SmolLM2-135M-Instruct, the whole batch in
one forward (the reference) against ``warm_start.micro_batch_size`` micro-batches, each beside the
memory check's estimate (:func:`trainer.app.memory_check.sft_memory_plan`).

The math main job's warm-start (``configs/math_tool/cpu_smollm.yaml``: a full fine-tune, float32
weights under bf16 autocast, sdpa) over ``--rows`` traces of ``--tokens`` tokens each (one action
piece of repeated words; its real traces are 262 tokens at the median and 641 at most), one
``--steps`` optimizer steps (default 3: the first step's peak comes before AdamW's state exists,
and later steps' peaks are higher than the first's by more than that state) per row of the table,
each row in its own fresh process. Measured: the child's peak RSS (``VmHWM``: its own peak, not
its parent's; see ``peak_memory.py``) and the step's seconds. Goals: the micro-batched peak ≤ 0.5 ×
the reference's, and every estimate within 25 % of its measured peak (the check refuses on the
estimate: an estimate far below the peak would let a run be OOM-killed). Exit status 1 when a goal is missed.

Usage: ``.venv/bin/python benchmarks/bench_sft_memory.py [--rows 16 --tokens 640 --micro 4]``;
``--child MICRO`` runs one row (used by the table and by ``tests/trainer/app/test_memory_check.py``).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from peak_memory import peak_rss_bytes  # noqa: E402
from real_bench_model import DEFAULT_MODEL, real_model_dir  # noqa: E402

CONFIG = ROOT / "configs" / "math_tool" / "cpu_smollm.yaml"
MEMORY_GOAL, ESTIMATE_TOLERANCE = 0.5, 0.25


def _traces(tok, rows: int, tokens: int) -> list:
    """``rows`` traces of ``tokens`` tokens (prompt + one action), exactly."""
    from trainer.warmstart import tokenize_trace
    from trainer.warmstart.traces import Trace

    prompt = "Solve the problem with Python.\n\nProblem: what is 2 + 2?\n"
    action = " apple" * tokens
    first = tokenize_trace(tok, Trace(prompt, (("action", action),)))[0]
    action = " apple" * (tokens - (len(first) - tokens))  # one token per " apple"; EOS included
    return [Trace(prompt, (("action", action),)) for _ in range(rows)]


def child(args: argparse.Namespace) -> None:
    """``--steps`` warm-start steps in this process; print ``{"peak_rss", "seconds", "tokens"}``."""
    import torch

    from trainer.config.learner_section import DEFAULT_MMAP_THRESHOLD
    from trainer.learner.allocator import set_malloc_mmap_threshold
    from trainer.models.loading import load_model_and_tokenizer
    from trainer.warmstart import sft_warm_start, tokenize_trace

    set_malloc_mmap_threshold(DEFAULT_MMAP_THRESHOLD)  # as copc train sets it before the warm-start
    torch.set_num_threads(2)
    model, tok = load_model_and_tokenizer(args.model, dtype=torch.float32, attn_implementation="sdpa")
    traces = _traces(tok, args.rows, args.tokens)
    t0 = time.perf_counter()
    sft_warm_start(model, tok, traces, steps=args.steps, batch_size=args.rows, lr=1e-5, seed=0,
                   progress=False, autocast_dtype=torch.bfloat16, micro_batch_size=args.child)
    print(json.dumps({"peak_rss": peak_rss_bytes(),
                      "seconds": (time.perf_counter() - t0) / args.steps,
                      "tokens": len(tokenize_trace(tok, traces[0])[0])}))


def run_row(micro: int, args: argparse.Namespace) -> dict:
    """One row (``micro`` traces per forward; 0: the whole batch) in a fresh process, with the estimate."""
    from trainer.app.memory_check import sft_memory_plan
    from trainer.config import load_config
    from trainer.models.memory_estimate import estimate_memory

    cmd = [sys.executable, __file__, "--child", str(micro), "--model", str(args.model),
           "--rows", str(args.rows), "--tokens", str(args.tokens), "--steps", str(args.steps)]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    if proc.returncode != 0:
        raise RuntimeError(f"micro {micro}: exit {proc.returncode}: {proc.stderr.strip().splitlines()[-1:]}")
    row = json.loads(proc.stdout.strip().splitlines()[-1])
    cfg = load_config(CONFIG, [f"model.path={args.model}"])
    row["estimate"] = estimate_memory(sft_memory_plan(cfg, micro or args.rows, row["tokens"])).total
    return row


def main() -> int:
    """Run the reference and the micro-batched row, print the table; 1 when a goal is missed."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=640)
    ap.add_argument("--micro", type=int, default=4)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--child", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    model, why = real_model_dir(args.model)
    if model is None:
        print(f"bench_sft_memory: skipped ({why})")
        return 0
    args.model = model
    if args.child is not None:
        child(args)
        return 0
    rows = {m: run_row(m, args) for m in (0, args.micro)}
    print(f"warm-start, {args.rows} traces x {rows[0]['tokens']} tokens, SmolLM2 float32 + bf16 autocast")
    print(f"{'traces per forward':>20} {'peak RSS GiB':>13} {'estimate GiB':>13} {'peak/est':>9} "
          f"{'s/step':>7}")
    for m, r in rows.items():
        print(f"{m or args.rows:>20} {r['peak_rss'] / 2**30:>13.2f} {r['estimate'] / 2**30:>13.2f} "
              f"{r['peak_rss'] / r['estimate']:>9.2f} {r['seconds']:>7.1f}")
    ratio = rows[args.micro]["peak_rss"] / rows[0]["peak_rss"]
    ok_est = all(abs(r["peak_rss"] / r["estimate"] - 1) <= ESTIMATE_TOLERANCE for r in rows.values())
    print(f"micro-batched / whole peak: {ratio:.2f} (goal <= {MEMORY_GOAL}); estimates within "
          f"{ESTIMATE_TOLERANCE:.0%}: {ok_est}")
    return 0 if ratio <= MEMORY_GOAL and ok_est else 1


if __name__ == "__main__":
    sys.exit(main())
