"""Benchmark: the embedded engine on SmolLM2-135M-Instruct vs Hugging Face ``generate``.

The real model (``--model``: a directory or a pulled name, default ``smollm2-135m-instruct``;
skipped with a note when it is not available) in float32 on the CPU, ``sdpa`` attention in every
arm. 32 chat-templated prompts (system + user, 66-82 tokens each), ``max_new_tokens`` = 128,
``ignore_eos``, temperature 1:

* ours: ``asyncio.gather`` of 32 :meth:`EmbeddedEngine.generate` calls (continuous batching,
  ``max_batch_size`` 32);
* HF ``generate`` at batch 1: the first ``--b1-requests`` prompts one after the other (its
  tokens/s does not depend on how many);
* HF ``generate`` at batch 16: the 32 prompts as two left-padded batches of 16.

Arms are interleaved, best of ``--repeats`` each (wall clock), in generated tokens per second; the
table also gives tokens per CPU-second of the process (less sensitive to other load on a shared
box; with 1 thread it is the rate the arm would reach alone). Goals (issue 22): ours >= 4x batch 1
and >= 1.5x batch 16.

Memory-bandwidth limit: a decode step must read every weight once (``weight bytes``, tied
embeddings counted once), so with copy bandwidth ``BW`` (STREAM convention: 2 x bytes / s of a
512 MB tensor copy, best of 5) a step takes at least ``weight bytes / BW``. Reported: that bound,
the measured decode step at 32 rows (:class:`ContinuousBatcher`, context ~130-260 tokens) and
the fraction ``bound / step``, and the same fraction for HF batch 1 (one token per step).
Run: ``python benchmarks/bench_engine_smollm2.py [--torch-threads 2]``.
"""

from __future__ import annotations

import argparse
import asyncio
import time

import torch
from real_bench_model import DEFAULT_MODEL, real_model_dir  # benchmarks/ is on sys.path

from trainer.engines.base import SamplingParams
from trainer.engines.continuous import ContinuousBatcher
from trainer.engines.embedded import EmbeddedEngine, EmbeddedEngineConfig
from trainer.models.loading import load_model_and_tokenizer

GOAL_B1, GOAL_B16 = 4.0, 1.5
SYSTEM = ("You are a helpful assistant. Read the question carefully, think about what is asked, "
          "explain your reasoning in a few short sentences and then give the final answer on its "
          "own line, starting with 'Answer:'.")
TOPICS = ["the boiling point of water at high altitude", "why the sky is blue", "how vaccines work",
          "the causes of the French Revolution", "what a prime number is", "how tides form",
          "the difference between weather and climate", "how a bicycle stays upright"]


def make_prompts(tok, n: int) -> list[list[int]]:
    """``n`` distinct chat-templated prompts (system + user; 66-82 SmolLM2 tokens each)."""
    out = []
    for i in range(n):
        q = (f"Question {i + 1}: explain {TOPICS[i % len(TOPICS)]}"
             + ", and give one everyday example" * (i % 3) + ".")
        ids = tok.apply_chat_template([{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}],
                                      add_generation_prompt=True, tokenize=True, return_dict=False)
        out.append(list(ids))
    return out


def timed(fn) -> tuple[float, float, int]:
    """``(wall s, CPU s of this process, tokens)`` of ``fn() -> tokens``."""
    w, c = time.perf_counter(), time.process_time()
    n = fn()
    return time.perf_counter() - w, time.process_time() - c, n


def run_ours(engine: EmbeddedEngine, prompts: list[list[int]], new: int) -> int:
    """Generated tokens of all prompts submitted concurrently."""
    sp = SamplingParams(temperature=1.0, max_new_tokens=new, ignore_eos=True)

    async def go() -> int:
        res = await asyncio.gather(*(engine.generate(p, sp) for p in prompts))
        return sum(len(r.token_ids) for r in res)
    return asyncio.run(go())


@torch.no_grad()
def run_hf(model, tok, prompts: list[list[int]], new: int, batch: int) -> int:
    """Generated tokens of ``model.generate`` over ``prompts`` in left-padded batches of ``batch``."""
    n = 0
    for s in range(0, len(prompts), batch):
        ps = prompts[s:s + batch]
        L = max(map(len, ps))
        ids = torch.full((len(ps), L), tok.pad_token_id, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, p in enumerate(ps):
            ids[i, L - len(p):], mask[i, L - len(p):] = torch.tensor(p), 1
        out = model.generate(ids, attention_mask=mask, do_sample=True, temperature=1.0, top_p=1.0, top_k=0,
                             max_new_tokens=new, min_new_tokens=new, pad_token_id=tok.pad_token_id)
        n += (out.shape[1] - L) * len(ps)
    return n


def copy_bandwidth(mbytes: int = 512) -> float:
    """Bytes/s of a large tensor copy, counting the read and the write (best of 5)."""
    src = torch.ones(mbytes * 2**20 // 4)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(6):
        t = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t)
    return 2 * src.numel() * 4 / best


@torch.no_grad()
def decode_step_s(model, tok, prompts: list[list[int]], steps: int = 16) -> float:
    """Mean seconds of one decode step with all ``prompts`` running (after 4 warm-up steps)."""
    b = ContinuousBatcher(model, tok, len(prompts))
    sp = SamplingParams(max_new_tokens=steps + 8, ignore_eos=True)
    b.admit([b.new_row(None, p, sp, 0) for p in prompts])
    for _ in range(4):
        b.step()
    t = time.perf_counter()
    for _ in range(steps):
        b.step()
    return (time.perf_counter() - t) / steps


def main() -> int:
    """Run the benchmark and print the table; exit status 0 (goals are reported, not enforced)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=DEFAULT_MODEL, help="model directory or pulled name")
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--b1-requests", type=int, default=3, help="prompts the batch-1 reference decodes")
    ap.add_argument("--repeats", type=int, default=2, help="best of this many runs per arm (interleaved)")
    ap.add_argument("--torch-threads", type=int, default=1,
                    help="torch intra-op threads (0: torch's default); on a shared 2-core box 2 threads "
                         "spin-wait on each other, so the default is 1")
    args = ap.parse_args()

    path, why = real_model_dir(args.model)
    if path is None:
        print(f"skipped: {why}")
        return 0
    if args.torch_threads > 0:
        torch.set_num_threads(args.torch_threads)
    model, tok = load_model_and_tokenizer(path, attn_implementation="sdpa")
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())  # tied: counted once
    prompts = make_prompts(tok, args.requests)
    lens = [len(p) for p in prompts]
    print(f"{path.name}: {sum(p.numel() for p in model.parameters()) / 1e6:.1f} M params, "
          f"{weight_bytes / 1e6:.0f} MB fp32; {len(prompts)} prompts of {min(lens)}-{max(lens)} tokens, "
          f"{args.max_new_tokens} new tokens; torch threads {torch.get_num_threads()}", flush=True)

    engine = EmbeddedEngine(model, tok, EmbeddedEngineConfig(max_batch_size=args.requests))
    run_ours(engine, prompts[:2], 4)  # warm-up
    run_hf(model, tok, prompts[:1], 4, 1)
    new = args.max_new_tokens
    arms = {"ours, 32 concurrent": lambda: run_ours(engine, prompts, new),
            "HF generate, batch 16": lambda: run_hf(model, tok, prompts, new, 16),
            "HF generate, batch 1": lambda: run_hf(model, tok, prompts[: args.b1_requests], new, 1)}
    runs: dict[str, list] = {k: [] for k in arms}
    for r in range(args.repeats):
        for name, fn in arms.items():
            runs[name].append(timed(fn))
            w, c, n = runs[name][-1]
            print(f"  round {r + 1} {name}: {n} tokens in {w:.1f} s (CPU {c:.1f} s)", flush=True)
    asyncio.run(engine.close())
    best = {k: min(v, key=lambda x: x[0]) for k, v in runs.items()}
    cpu = {k: min(v, key=lambda x: x[1]) for k, v in runs.items()}

    bw = copy_bandwidth()
    step = decode_step_s(model, tok, prompts)
    bound = weight_bytes / bw
    ours = best["ours, 32 concurrent"]
    print(f"\n{'arm':>22} | {'tokens':>6} | {'wall s':>7} | {'tok/s':>6} | {'tok/CPU-s':>9}")
    print(f"{'-' * 22}-+-{'-' * 6}-+-{'-' * 7}-+-{'-' * 6}-+-{'-' * 9}")
    for k, (w, _, n) in best.items():
        print(f"{k:>22} | {n:>6} | {w:>7.1f} | {n / w:>6.1f} | {n / cpu[k][1]:>9.1f}")
    verdicts = []
    for ref, goal in (("HF generate, batch 1", GOAL_B1), ("HF generate, batch 16", GOAL_B16)):
        w, _, n = best[ref]
        x = (ours[2] / ours[0]) / (n / w)
        xc = (ours[2] / cpu["ours, 32 concurrent"][1]) / (n / cpu[ref][1])
        verdicts.append(f"goal: >= {goal:g}x {ref}: {'met' if x >= goal else 'NOT met'} "
                        f"({x:.2f}x wall, {xc:.2f}x per CPU-second)")
    b1_w, _, b1_n = best["HF generate, batch 1"]
    print(f"\nmemory: copy bandwidth {bw / 1e9:.1f} GB/s (2 x bytes / s); weights "
          f"{weight_bytes / 1e6:.0f} MB -> bound {bound * 1e3:.0f} ms per decode step")
    print(f"decode step with {len(prompts)} rows: {step * 1e3:.0f} ms ({len(prompts) / step:.0f} tok/s): "
          f"{bound / step:.0%} of the bandwidth limit; HF batch 1: {b1_n / b1_w * bound:.0%} of it "
          f"({b1_n / b1_w:.1f} tok/s vs {1 / bound:.1f} tok/s bound)")
    print("\n".join(verdicts))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
