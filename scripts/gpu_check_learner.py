"""Step ``learner_steps`` of ``scripts/gpu_check.py``: the learner backends on the device vs an
fp32 torch reference (docs/gpu_check.md).

Each run builds one backend on a tiny Qwen2 (hidden 64, 2 layers, tied embeddings; actor + critic)
and takes two COPC learner steps (AdamW, lr 1e-3, two PPO mini-batches of micro-batch 2, clipping
at 1.0) on two fixed two-turn batches. The reference is the torch backend in float32 on the CPU
(the configuration every CPU parity test of the project trusts). Compared per step: the losses
and gradient norms (``actor/pg_loss``, ``actor/grad_norm``, ``critic/value_loss``,
``critic/grad_norm``; step 2 also checks the optimizer's update, since its losses are those of the
updated weights), ``|got − ref| ≤ tol · max(1, |ref|)`` with ``tol`` = 1e-4 for float32 runs and
2e-2 for bfloat16 runs; also reported, not gated: the largest difference over all other metrics
and over the exported policy weights after the two steps.

Runs: torch, fsdp (world 1) and megatron (TP 1, world 1) in bfloat16, then the same in float32.
On CUDA the distributed ones use NCCL and their ranks put the models on the GPU; the megatron run
then goes through Megatron's distributed optimizer (``get_megatron_optimizer``), the path the
CPU tests cannot reach. In ``--device cpu`` mode: gloo; megatron bf16 is skipped (its CPU path
runs float32 only) and torch fp32 is skipped (it is the reference itself). torch bf16 is skipped
everywhere: that backend refuses to fully fine-tune low-precision weights (AdamW's updates would
round away; ``trainer.learner.lora.check_trainable_dtype``), so bf16 mixed precision is checked
through fsdp.
"""

from __future__ import annotations

import math
import time
import traceback
from pathlib import Path
from typing import Any

KEY_METRICS = ("actor/pg_loss", "actor/grad_norm", "critic/value_loss", "critic/grad_norm")
TOLERANCE = {"float32": 1e-4, "bfloat16": 2e-2}
PLAN = (("torch", "bfloat16"), ("fsdp", "bfloat16"), ("megatron", "bfloat16"),
        ("torch", "float32"), ("fsdp", "float32"), ("megatron", "float32"))
#: Seconds a run needs at least (spawning ranks, importing Megatron): else skipped for time.
MIN_SECONDS = {"torch": 10.0, "fsdp": 30.0, "megatron": 45.0}


def overrides(backend: str, dtype: str, device: str, timeout_s: float = 120.0) -> list[str]:
    """Config overrides of one run (``backend`` in torch | fsdp | megatron); ``timeout_s`` bounds a
    distributed run's wait for its ranks (``learner.backend_settings.timeout_s``: a hung rank fails this
    run, not the whole step)."""
    o = {"preset": "copc", "model.dtype": dtype, "train.actor_lr": "1e-3", "train.critic_lr": "1e-3",
         "train.micro_batch_size": "2", "train.num_mini_batches": "2", "train.grad_clip": "1.0",
         "learner.optimizer": "adamw", "rollout.n_samples_per_prompt": "2"}
    if backend != "torch":
        o.update({"learner.backend": backend, "learner.backend_settings.world_size": "1",
                  "learner.backend_settings.dist_backend": "nccl" if device == "cuda" else "gloo",
                  "learner.backend_settings.timeout_s": f"{timeout_s:.0f}"})
    return [f"{k}={v}" for k, v in o.items()]


def fixed_batch(n: int, seed: int) -> Any:
    """``n`` two-turn episodes (prompt, 3 model tokens, 1 observation token, 2 + i model tokens)
    with off-policy behavior log-probs (−5, −5.5), rewards 0/1 alternating, groups of 2: a
    :class:`~trainer.rollout.batch.RolloutBatch` on the CPU."""
    import torch

    from trainer.rollout.batch import to_batch
    from trainer.rollout.trajectory import Trajectory

    g = torch.Generator().manual_seed(seed)
    trs = []
    for i in range(n):
        tr = Trajectory(prompt_ids=[40 + i, 41, 42][: 2 + i % 2], sample_id=i, group_id=i // 2)
        ids = torch.randint(0, 255, (6 + i,), generator=g).tolist()
        tr.append_model_tokens(ids[:3], [-5.0] * 3, 0)
        tr.append_observation_tokens(ids[3:4])
        tr.append_model_tokens(ids[4:], [-5.5] * len(ids[4:]), 0)
        tr.reward = float(i % 2)
        trs.append(tr)
    return to_batch(trs, 0)


def _torch_learner(cfg: Any, model_dir: Path, device: str) -> Any:
    """The torch backend (``make_learner``, built on the CPU) with its actor and critic then moved to
    ``device``: ``Module.to`` keeps the parameter objects, so the optimizers (no state yet) follow.
    (Built on the CPU first because ``ValueModel.from_causal_lm`` creates the value head on the
    CPU whatever the backbone's device.)"""
    from trainer.config.specs import learner_spec
    from trainer.learner import make_learner

    lrn = make_learner(learner_spec(cfg), model_dir)
    lrn.actor.to(device)
    if lrn.critic is not None:
        lrn.critic.to(device)
    return lrn


def run_backend(backend: str, dtype: str, device: str, model_dir: Path, batches: list[Any],
                timeout_s: float = 120.0) -> dict:
    """Build ``backend`` in ``dtype`` (torch: on ``device``), step it once per batch (``timeout_s``:
    :func:`overrides`).

    Returns:
        ``{"metrics": [dict per step], "weights": {HF name: float32 CPU tensor}, "build_s": float,
        "step_s": [float], "cuda_max_mem_mib": float | None}``.
    """
    import torch

    from trainer.config import load_config
    from trainer.config.specs import learner_spec
    from trainer.learner import make_learner
    from trainer.learner.distributed.shard import batch_to

    cfg = load_config(None, overrides(backend, dtype, device, timeout_s))
    on_cuda = device == "cuda" and torch.cuda.is_available()
    if on_cuda:
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    metrics, step_s = [], []
    if backend == "torch":
        lrn = _torch_learner(cfg, model_dir, device)
        build = time.perf_counter() - t0
        for b in batches:
            t1 = time.perf_counter()
            metrics.append(lrn.step(batch_to(b, torch.device(device))))
            step_s.append(time.perf_counter() - t1)
        weights = dict(lrn.export_policy_weights())
    else:
        with make_learner(learner_spec(cfg), model_dir) as lrn:
            build = time.perf_counter() - t0
            for b in batches:
                t1 = time.perf_counter()
                metrics.append(lrn.step(b))
                step_s.append(time.perf_counter() - t1)
            weights = dict(lrn.export_policy_weights())
    mem = torch.cuda.max_memory_allocated() / 2**20 if on_cuda and backend == "torch" else None
    return {"metrics": metrics, "weights": {k: v.detach().float().cpu() for k, v in weights.items()},
            "build_s": build, "step_s": step_s, "cuda_max_mem_mib": mem}


def compare(ref: dict, got: dict, tol: float) -> dict:
    """Differences of ``got`` from ``ref`` (:func:`run_backend` outputs).

    Returns:
        ``{"steps": [{metric: {"ref", "got", "abs", "scaled"}}], "max_scaled_key": float,
        "max_abs_other": float, "max_abs_other_key": str, "weights_max_abs_diff": float,
        "within_tolerance": bool}``; ``scaled`` = ``|got − ref| / max(1, |ref|)``, gated against
        ``tol`` for :data:`KEY_METRICS`; a non-finite value fails.
    """
    steps, worst, other, other_key, finite = [], 0.0, 0.0, "", True
    for r, g in zip(ref["metrics"], got["metrics"], strict=True):
        row = {}
        for k in KEY_METRICS:
            if k in r:
                a, b = float(r[k]), float(g.get(k, math.nan))
                d = abs(a - b)
                row[k] = {"ref": a, "got": b, "abs": d, "scaled": d / max(1.0, abs(a))}
                finite &= math.isfinite(b)
                worst = max(worst, row[k]["scaled"]) if math.isfinite(d) else math.inf
        for k, a in r.items():
            if k in KEY_METRICS or k.startswith("perf/") or not isinstance(a, (int, float)):
                continue
            b = g.get(k)
            if isinstance(b, (int, float)) and math.isfinite(a) and math.isfinite(b) and abs(a - b) > other:
                other, other_key = abs(a - b), k
        steps.append(row)
    rw, gw = ref["weights"], got["weights"]
    wdiff = max((float((rw[n] - gw[n]).abs().max()) for n in set(rw) & set(gw)), default=math.nan)
    missing = sorted(set(rw) ^ set(gw))
    return {"steps": steps, "max_scaled_key": worst, "max_abs_other": other, "max_abs_other_key": other_key,
            "weights_max_abs_diff": wdiff, "weights_missing": missing,
            "within_tolerance": finite and worst <= tol and not missing}


def optimizer_path(backend: str, device: str) -> str:
    """Which optimizer code a run exercises (see trainer/learner/backends/megatron/optim.py)."""
    if backend == "megatron":
        return ("Megatron distributed optimizer (get_megatron_optimizer)" if device == "cuda"
                else "torch AdamW over Megatron DDP main_grad (CPU path)")
    return "torch AdamW over FSDP2 shards" if backend == "fsdp" else "torch AdamW"


def skip_reason(backend: str, dtype: str, device: str) -> str | None:
    """Why a run of :data:`PLAN` does not apply in this mode (None: it runs)."""
    if device == "cpu" and backend == "megatron" and dtype == "bfloat16":
        return "needs CUDA: the megatron backend runs float32 only on CPU (bf16 is its GPU path)"
    if device == "cpu" and backend == "torch" and dtype == "float32":
        return "on CPU this is the reference run itself"
    if backend == "torch" and dtype == "bfloat16":
        return ("by design: the torch backend trains float32 weights only (a fully fine-tuned bf16 "
                "model is a ConfigError, tests/trainer/learner/test_lora.py); bf16 mixed precision is fsdp's")
    return None


def _fmt(x: Any) -> str:
    return f"{x:.2e}" if isinstance(x, float) else ("" if x is None else str(x))


def details_md(res: dict) -> list[str]:
    """Markdown lines: one table row per run (status, scaled key-metric difference vs tolerance,
    largest other-metric and weight differences, optimizer path, build and step seconds)."""
    lines = ["| run | status | key metrics Δ (scaled) | tol | other metrics Δ | weights Δ | optimizer | "
             "build s | step s |", "|---|---|---|---|---|---|---|---|---|"]
    for name, r in res["runs"].items():
        status = r["status"] + (f": {r['reason']}" if r.get("reason") else "")
        steps = ", ".join(f"{t:.2f}" for t in r.get("step_s", []))
        other = f"{_fmt(r.get('max_abs_other'))} {r.get('max_abs_other_key', '')}".strip()
        lines.append(f"| {name} | {status.replace('|', '/')[:300]} | {_fmt(r.get('max_scaled_key'))} | "
                     f"{TOLERANCE[r['dtype']]:g} | {other} | {_fmt(r.get('weights_max_abs_diff'))} | "
                     f"{r['optimizer']} | {_fmt(r.get('build_s'))} | {steps} |")
    ref = res["reference"]["metrics"]
    lines += ["", "Reference (torch, float32, CPU): " + "; ".join(
        f"step {i + 1}: " + ", ".join(f"{k} {v:.5f}" for k, v in m.items()) for i, m in enumerate(ref))]
    return lines


def step_learner(ctx: Any) -> dict:
    """Run :data:`PLAN` against the reference; passed iff every run that ran is within tolerance.

    Writes partial results after each run (a step timeout keeps what was measured)."""
    import torch

    from trainer.models.tiny import TinyModelConfig, save_tiny_checkpoint

    model_dir = save_tiny_checkpoint(ctx.work / "tiny_learner",
                                     TinyModelConfig(hidden_size=64, intermediate_size=128, num_layers=2))
    batches = [fixed_batch(6, 0), fixed_batch(5, 1)]
    t0 = time.perf_counter()
    ref = run_backend("torch", "float32", "cpu", model_dir, batches)
    res: dict[str, Any] = {"reference": {"backend": "torch", "dtype": "float32", "device": "cpu",
                                         "wall_s": time.perf_counter() - t0,
                                         "metrics": [{k: m[k] for k in KEY_METRICS if k in m}
                                                     for m in ref["metrics"]]},
                           "tolerance": TOLERANCE, "runs": {}, "status": "failed", "reason": "incomplete"}
    failed = []
    for backend, dtype in PLAN:
        name = f"{backend}_{'bf16' if dtype == 'bfloat16' else 'fp32'}"
        why = skip_reason(backend, dtype, ctx.device)
        if why is None and ctx.left() < MIN_SECONDS[backend]:
            why = f"time budget: {ctx.left():.0f} s left"
        run: dict[str, Any] = {"backend": backend, "dtype": dtype, "device": ctx.device,
                               "optimizer": optimizer_path(backend, ctx.device)}
        if why is not None:
            run.update(status="skipped", reason=why)
        else:
            t1 = time.perf_counter()
            try:
                got = run_backend(backend, dtype, ctx.device, model_dir, batches,
                                  timeout_s=max(20.0, min(120.0, ctx.left() - 10)))
                cmp = compare(ref, got, TOLERANCE[dtype])
                run.update(cmp, build_s=got["build_s"], step_s=got["step_s"],
                           cuda_max_mem_mib=got["cuda_max_mem_mib"],
                           status="passed" if cmp["within_tolerance"] else "failed",
                           reason=None if cmp["within_tolerance"] else
                           f"key metric off by {cmp['max_scaled_key']:.2e} (tol {TOLERANCE[dtype]:g})")
            except Exception as e:  # one backend's failure must not hide the others'
                run.update(status="failed", reason=f"{type(e).__name__}: {str(e)[-800:]}",
                           traceback=traceback.format_exc()[-3000:])
                traceback.print_exc()
            run["wall_s"] = time.perf_counter() - t1
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
        if run["status"] == "failed":
            failed.append(name)
        res["runs"][name] = run
        print(f"{name}: {run['status']} {run.get('reason') or ''} "
              f"(key {run.get('max_scaled_key', float('nan')):.2e})", flush=True)
        ctx.write({**res, "reason": "partial (step cut short)"})
    res["details_md"] = details_md(res)
    parts = []
    for name, run in res["runs"].items():
        mark = {"passed": "ok", "failed": "FAIL", "skipped": "skip"}[run["status"]]
        parts.append(f"{name} {mark}" + (f" {run['max_scaled_key']:.1e}" if "max_scaled_key" in run else ""))
    res.update(status="failed" if failed else "passed",
               reason=f"failed: {', '.join(failed)}" if failed else None, headline="; ".join(parts))
    return res
