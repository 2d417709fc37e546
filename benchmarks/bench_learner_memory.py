"""Benchmark: peak memory and speed of one actor + critic learner step on SmolLM2-135M-Instruct,
today's full-logits path (the reference) vs the chunked log-prob path.

One step of the torch learner (preset ``copc``: actor + critic, AdamW, one mini-batch, one
micro-batch of all rows, float32, eager attention, the defaults) over ``--rows`` episodes of
``--prompt-tokens`` prompt + ``--response-tokens`` model tokens (default 8 × (64 + 512)), each row
of the table in its own fresh process:

* ``full logits`` (reference): the actor's log-probs from ``model(...).logits``, the whole
  ``(B, P + T, V)`` float tensor, then the response tokens (:class:`FullLogitsLearner`, the torch
  learner's path before the chunked one; kept here only, as the reference);
* ``chunked``: the learner as shipped (hidden states at the model tokens, LM head + log-softmax in
  chunks of ``learner.backend_settings.logprob_chunk_tokens`` with recomputation in backward, plus
  the entropy metric);
* ``chunked + ckpt``: the same with ``learner.backend_settings.gradient_checkpointing=true``;
* ``chunked + ckpt, mmap 1 MiB``: the same with ``learner.malloc_mmap_threshold=1048576`` (the
  low-memory allocator option): what it saves and what it costs;
* ``chunked, bf16 autocast`` / ``chunked + ckpt, bf16 autocast``: the chunked rows with
  ``learner.backend_settings.autocast_dtype=bfloat16`` (forward passes in bfloat16, float32 weights
  and optimizer state; log-probs within bfloat16 rounding of the float32 ones, not equal).

Measured: the child's peak RSS (its own ``VmHWM``, ``peak_memory.py``: model, optimizer state,
activations, interpreter), its RSS before the step, and response tokens per second of the
step. Goals (issue 22): peak RSS ≤ 0.35 × the reference's, tokens/s ≥ 0.9 × the reference's,
printed for every row; the exit status is the row named by ``--gate`` (default ``chunked + ckpt,
mmap 1 MiB``: the settings a run that must fit uses,
``learner.backend_settings.gradient_checkpointing: true`` and ``learner.malloc_mmap_threshold:
1048576``). The reference peaks near 14 GB at the
default size: on a shared machine run it under ``flock`` (``make bench`` does not).

Allocator retention: with glibc's default (dynamic) mmap threshold, tensors of up to 32 MB come
from the heap after the first large frees, and freed heap memory mostly stays resident; at the
default size that keeps ~2 GB more RSS than the live tensors in the chunked rows. A fixed
threshold (``learner.malloc_mmap_threshold``, :mod:`trainer.learner.allocator`, default 0 = glibc's
own) returns it, at the price of page-faulting every large allocation afresh. Every row runs with
the shipped default except the ``mmap 1 MiB`` row (``--mmap-threshold`` sets that row's value).

Measured (2026-12-03, 2 idle cores, the default size, each row alone): full logits 15.76 GiB /
157 s; chunked 11.99 GiB / 194 s; chunked + ckpt (glibc default) 6.47–6.97 GiB (0.41–0.44x) /
176–212 s (0.74–0.89x); with a 1 MiB threshold 4.67 GiB (0.30x) / 224–256 s (0.61–0.70x), 8 MiB
4.75 GiB / 208–243 s, 32 MiB 6.84 GiB / 209 s. Under ``/usr/bin/time`` the 1 MiB threshold raised
minor page faults from 26.8 M to 47.2 M and system time from 106 s to 176 s per step. Neither
setting met both goals then: the memory goal needs the fixed threshold, whose page faults broke
the speed goal under that load.

Measured again (2026-12-04, 2 idle cores, load < 2, two runs, the default size; full logits 15.72 /
15.80 GiB, 115.3 / 115.8 s):

| row | peak RSS × ref | tokens/s × ref |
|---|---|---|
| chunked | 0.90 / 0.89 | 1.04 / 1.04 |
| chunked + ckpt | 0.44 / 0.40 | 1.13 / 1.18 |
| chunked + ckpt, mmap 1 MiB | **0.30 / 0.30** | **1.12 / 1.20** |
| chunked, bf16 autocast | 0.84 / 0.84 | 1.43 / 1.58 |
| chunked + ckpt, bf16 autocast | 0.37 / 0.36 | 1.53 / 1.94 |

Both goals are met by ``chunked + ckpt, mmap 1 MiB`` in both runs (4.73 GiB, 97–103 s). The
chunked head costs no speed here (1.04×: the reference's full logits are themselves slow to
allocate and fill), and checkpointing is faster than keeping the activations (fewer and
smaller allocations outweigh the second forward).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from peak_memory import peak_rss_bytes

#: The model (a pulled name, ``copc model pull smollm2-135m-instruct``, or a directory: ``--model``).
DEFAULT_MODEL = "smollm2-135m-instruct"
MEMORY_GOAL, SPEED_GOAL = 0.35, 0.9
#: Table rows: label -> (learner class, gradient checkpointing, the low-memory mmap threshold,
#: ``learner.backend_settings.autocast_dtype``).
ROWS = {"full logits": ("full", False, False, None), "chunked": ("chunked", False, False, None),
        "chunked + ckpt": ("chunked", True, False, None),
        "chunked + ckpt, mmap 1 MiB": ("chunked", True, True, None),
        "chunked, bf16 autocast": ("chunked", False, False, "bfloat16"),
        "chunked + ckpt, bf16 autocast": ("chunked", True, False, "bfloat16")}


def rss_bytes() -> int:
    """This process's current resident set (``/proc/self/statm``)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def child(args: argparse.Namespace) -> None:
    """Run one learner step in this process; print a JSON line (tokens, seconds, RSS before)."""
    import torch

    from trainer.config import load_config
    from trainer.config.specs import learner_spec
    from trainer.learner.allocator import set_malloc_mmap_threshold
    from trainer.learner.backends.torch import TorchLearner
    from trainer.logprobs import token_logprobs
    from trainer.rollout.batch import to_batch
    from trainer.rollout.trajectory import Trajectory

    class FullLogitsLearner(TorchLearner):
        """The reference: the actor's log-probs from the full ``(B, P + T, V)`` logits, no entropy."""

        def scores(self, mb, entropy):
            logits = self.actor(input_ids=mb.input_ids, attention_mask=mb.attention_mask,
                                position_ids=mb.position_ids).logits
            lp = token_logprobs(logits[:, mb.prompt_len - 1:-1], mb.response_ids, self.cfg.temperature)
            return lp, None

    kind, ckpt, low_memory, autocast = ROWS[args.child]
    threshold = args.mmap_threshold if low_memory else None  # None: the shipped default
    cfg = load_config(None, ["preset=copc", f"train.micro_batch_size={args.rows}", "train.num_mini_batches=1",
                             "train.actor_lr=1e-6",
                             f"learner.backend_settings.gradient_checkpointing={str(ckpt).lower()}",
                             f"learner.backend_settings.logprob_chunk_tokens={args.chunk}",
                             f"model.attn_implementation={args.attn}",
                             f"learner.backend_settings.autocast_dtype={autocast or 'null'}"]
                      + ([] if threshold is None else [f"learner.malloc_mmap_threshold={threshold}"]))
    set_malloc_mmap_threshold(cfg.learner.malloc_mmap_threshold)  # as copc train does
    learner = (FullLogitsLearner if kind == "full" else TorchLearner).from_spec(learner_spec(cfg), args.model)
    g = torch.Generator().manual_seed(0)
    V = learner.actor.config.vocab_size
    trs = []
    for i in range(args.rows):
        tr = Trajectory(prompt_ids=torch.randint(0, V, (args.prompt_tokens,), generator=g).tolist(),
                        sample_id=i, group_id=i)
        tr.append_model_tokens(torch.randint(0, V, (args.response_tokens,), generator=g).tolist(),
                               [-3.0] * args.response_tokens, 0)
        tr.reward = float(i % 2)
        trs.append(tr)
    batch = to_batch(trs, 0)
    before = rss_bytes()
    t0 = time.perf_counter()
    metrics = learner.step(batch)
    seconds = time.perf_counter() - t0
    peak = peak_rss_bytes()  # VmHWM: this process's own peak (ru_maxrss carries the parent's)
    print(json.dumps({"tokens": int(batch.loss_mask.sum()), "seconds": seconds, "rss_before": before,
                      "peak_rss": peak, "pg_loss": metrics["actor/pg_loss"]}), flush=True)


def run_row(label: str, args: argparse.Namespace) -> dict:
    """One row in a fresh child process: its JSON line (``peak_rss``: the child's own
    ``VmHWM`` peak, bytes)."""
    cmd = [sys.executable, __file__, "--child", label, "--model", str(args.model), "--rows", str(args.rows),
           "--prompt-tokens", str(args.prompt_tokens), "--response-tokens", str(args.response_tokens),
           "--chunk", str(args.chunk), "--mmap-threshold", str(args.mmap_threshold), "--attn", args.attn]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{label}: exit {proc.returncode}: {proc.stderr.strip().splitlines()[-1:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> int:
    """Run the rows, print the table; non-zero exit when the gated row misses a goal."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--response-tokens", type=int, default=512)
    ap.add_argument("--chunk", type=int, default=512, help="learner.backend_settings.logprob_chunk_tokens")
    ap.add_argument("--gate", default="chunked + ckpt, mmap 1 MiB",
                    choices=[r for r in ROWS if r != "full logits"])
    ap.add_argument("--mmap-threshold", type=int, default=2**20,
                    help="learner.malloc_mmap_threshold of the 'mmap 1 MiB' row (bytes)")
    ap.add_argument("--attn", default="eager", choices=["eager", "sdpa"],
                    help="model.attn_implementation of every row (eager: the default)")
    ap.add_argument("--child", choices=list(ROWS), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args)
        return 0
    from trainer.errors import ConfigError
    from trainer.models.pull.store import resolve_model_path

    try:
        args.model = resolve_model_path(args.model, "--model")
    except ConfigError as e:
        print(f"skipped: {e}")
        return 0
    print(f"model: {args.model}; one actor + critic step (copc, AdamW), {args.rows} x ({args.prompt_tokens} "
          f"prompt + {args.response_tokens} model tokens), float32, {args.attn} attention, chunk "
          f"{args.chunk}, torch threads {os.environ.get('OMP_NUM_THREADS', 'default')}, malloc mmap "
          f"threshold of the low-memory row {args.mmap_threshold}")
    results = {label: run_row(label, args) for label in ROWS}
    ref = results["full logits"]
    ref_tps = ref["tokens"] / ref["seconds"]
    print(f"{'path':<31}{'peak RSS GiB':>13}{'x ref':>7}{'RSS before GiB':>16}{'step s':>9}{'tok/s':>8}"
          f"{'x ref':>7}")
    for label, r in results.items():
        tps = r["tokens"] / r["seconds"]
        print(f"{label:<31}{r['peak_rss'] / 2**30:13.2f}{r['peak_rss'] / ref['peak_rss']:7.2f}"
              f"{r['rss_before'] / 2**30:16.2f}{r['seconds']:9.1f}{tps:8.1f}{tps / ref_tps:7.2f}")
    passed = {}
    for label, r in results.items():
        if label == "full logits":
            continue
        mem, speed = r["peak_rss"] / ref["peak_rss"], r["tokens"] / r["seconds"] / ref_tps
        ok_mem, ok_speed = mem <= MEMORY_GOAL, speed >= SPEED_GOAL
        passed[label] = ok_mem and ok_speed
        print(f"goals ({label}{', gated' if label == args.gate else ''}): peak RSS {mem:.2f} x "
              f"(<= {MEMORY_GOAL}): {'PASS' if ok_mem else 'FAIL'}; tokens/s {speed:.2f} x "
              f"(>= {SPEED_GOAL}): {'PASS' if ok_speed else 'FAIL'}")
    return 0 if passed[args.gate] else 1


if __name__ == "__main__":
    raise SystemExit(main())
