"""The steps of ``scripts/gpu_check.py`` (each runs in its own process; docs/gpu_check.md).

Every step takes a :class:`StepContext` and returns a JSON-able dict with ``status``
(``passed`` | ``failed`` | ``skipped``), an optional ``reason``, a one-line ``headline`` and its
numbers. Steps: ``env`` (versions, device, sandbox), ``pytest_gpu`` (the gpu-marked tests),
``learner_steps`` (:mod:`gpu_check_learner`), ``logprob_parity`` (embedded engine vs learner
log-probs on the device) and ``run10`` (a short ``copc train`` of the cpu_tiny config with the
learner on the device).
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import platform
import re
import shutil
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class StepContext:
    """What a step gets.

    Attributes:
        device: ``cuda`` or ``cpu`` (the CPU mode runs the same logic with gloo, for testing).
        work: scratch directory shared by the steps (``work/artifacts`` is archived).
        deadline: ``time.time()`` after which the step is killed (seconds since the epoch).
        result: where the step's result JSON goes (also written early, as partial results).
        run_steps / warm_start_steps / eval_samples: sizes of the ``run10`` step.
    """

    device: str
    work: Path
    deadline: float
    result: Path
    run_steps: int = 10
    warm_start_steps: int = 100
    eval_samples: int = 8

    def left(self) -> float:
        """Seconds until :attr:`deadline`."""
        return self.deadline - time.time()

    def write(self, res: dict) -> None:
        """Write ``res`` as the step's (possibly partial) result."""
        self.result.write_text(json.dumps(res, default=str))

    @property
    def artifacts(self) -> Path:
        """``work/artifacts`` (created), archived into ``logs/artifacts.tar.gz``."""
        p = self.work / "artifacts"
        p.mkdir(parents=True, exist_ok=True)
        return p


def _version(dist: str) -> str | None:
    import importlib.metadata as md

    try:
        return md.version(dist)
    except md.PackageNotFoundError:
        return None


def _nccl_version() -> str | None:
    try:
        import torch

        v = torch.cuda.nccl.version()
        return ".".join(map(str, v)) if isinstance(v, tuple) else str(v)
    except Exception:  # informational only
        return None


def probe_sandbox() -> tuple[str, str]:
    """``(isolation, note)``: ``bwrap`` when a bwrap sandbox starts and runs code here, else
    ``process`` with the reason (the math_tool task's code tool then uses the weaker isolation).
    ``GPU_CHECK_SANDBOX=process`` forces the fallback (to test it where bwrap works)."""
    from environments.sandbox import Sandbox, SandboxConfig, SandboxUnavailableError

    if os.environ.get("GPU_CHECK_SANDBOX") == "process":
        return "process", "forced by GPU_CHECK_SANDBOX=process"

    try:
        sb = Sandbox(SandboxConfig(workers=1))
        try:
            r = sb.run("print(6 * 7)", timeout_s=20)
        finally:
            sb.close()
        if r.status == "ok" and r.stdout.strip() == "42":
            return "bwrap", ""
        return "process", f"bwrap sandbox ran code with status {r.status!r}: {r.reason}"
    except (SandboxUnavailableError, OSError) as e:
        return "process", f"bwrap unavailable: {str(e)[:300]}"


# -- env ------------------------------------------------------------------------------------------
def step_env(ctx: StepContext) -> dict:
    """Versions, the device (name, capability, memory; a bf16 matmul on it) and the sandbox.

    Fails when ``device == "cuda"`` and no CUDA device is visible or the matmul is wrong."""
    import torch

    res: dict[str, Any] = {
        "python": platform.python_version(), "python_executable": sys.executable, "torch": torch.__version__,
        "cuda": torch.version.cuda, "cuda_available": torch.cuda.is_available(),
        "transformers": _version("transformers"), "triton": _version("triton"),
        "megatron_core": _version("megatron-core"), "mbridge": _version("mbridge"),
        "cpu_count": os.cpu_count(), "bwrap": shutil.which("bwrap"), "device_name": "cpu"}
    iso, note = probe_sandbox()
    res["sandbox"] = iso + (f" ({note})" if note else "")
    (ctx.work / "sandbox.json").write_text(json.dumps({"isolation": iso, "note": note}))
    if ctx.device == "cuda":
        if not torch.cuda.is_available():
            return {**res, "status": "failed", "reason": "--device cuda but torch sees no CUDA device",
                    "headline": "no CUDA device"}
        props = torch.cuda.get_device_properties(0)
        res.update(device_name=props.name, capability=f"{props.major}.{props.minor}",
                   memory_gib=round(props.total_memory / 2**30, 1), device_count=torch.cuda.device_count(),
                   nccl=_nccl_version(), matmul_allow_tf32=torch.backends.cuda.matmul.allow_tf32)
    dev = torch.device(ctx.device)
    a = torch.randn(256, 256, generator=torch.Generator().manual_seed(0))
    got = (a.to(dev, torch.bfloat16) @ a.to(dev, torch.bfloat16).T).float().cpu()
    rel = float((got - a @ a.T).norm() / (a @ a.T).norm())
    res["bf16_matmul_rel_err"] = rel
    ok = rel < 1e-2
    res.update(status="passed" if ok else "failed", reason=None if ok else f"bf16 matmul error {rel:.2e}")
    res["headline"] = (f"{res['device_name']}, torch {res['torch']}, CUDA {res['cuda']}, py {res['python']}, "
                       f"sandbox {iso}")
    return res


# -- pytest -m gpu ----------------------------------------------------------------------------------
def gpu_test_files() -> list[Path]:
    """Test modules under ``tests/`` with a ``pytest.mark.gpu`` mark."""
    return sorted(p for p in (REPO / "tests").rglob("test_*.py")
                  if re.search(r"mark\.gpu\b", p.read_text(errors="replace")))


def step_pytest_gpu(ctx: StepContext) -> dict:
    """``pytest -m gpu`` over :func:`gpu_test_files` with a per-test timeout; counts from JUnit XML.

    Passed iff pytest exits 0 (skips allowed, listed with their reasons); skipped when no test
    file carries the mark."""
    files = gpu_test_files()
    if not files:
        return {"status": "skipped", "reason": "no gpu-marked tests", "headline": "no gpu-marked tests"}
    xml = ctx.artifacts / "pytest_gpu.xml"
    budget = max(10.0, ctx.left() - 5)
    cmd = [sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-rs", "-p", "no:cacheprovider",
           f"--junitxml={xml}", *[str(f.relative_to(REPO)) for f in files]]
    if _version("pytest-timeout"):
        cmd.insert(3, f"--timeout={int(budget)}")
    print(" ".join(cmd), flush=True)
    try:
        rc = subprocess.run(cmd, cwd=REPO, timeout=budget).returncode
    except subprocess.TimeoutExpired:
        rc = None
    counts = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0}
    skips: list[str] = []
    if xml.is_file():
        root = ET.parse(xml).getroot()
        for suite in root.iter("testsuite"):
            for k in counts:
                counts[k] += int(suite.get(k, 0))
        skips = sorted({(s.get("message") or "")[:200] for s in root.iter("skipped")})
    counts["passed"] = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
    res = {"files": [str(f.relative_to(REPO)) for f in files], "returncode": rc, **counts,
           "skip_reasons": skips, "headline": f"{counts['passed']} passed, {counts['skipped']} skipped, "
                       f"{counts['failures'] + counts['errors']} failed"}
    if rc == 0:
        return {**res, "status": "passed"}
    if rc == 5:
        return {**res, "status": "skipped", "reason": "no test selected by -m gpu"}
    return {**res, "status": "failed", "reason": "timeout" if rc is None else f"pytest exit code {rc}"}


# -- log-prob parity --------------------------------------------------------------------------------
def _generate(engine: Any, prompts: list[list[int]], params: Any) -> list[Any]:
    async def main() -> list[Any]:
        return list(await asyncio.gather(*(engine.generate(p, params) for p in prompts)))
    return asyncio.run(main())


def parity_batch(engine: Any, tok: Any, temperature: float, top_p: float, seed: int) -> Any:
    """Two-turn episodes sampled by ``engine``: prompt → model turn → observation → model turn,
    as a :class:`~trainer.rollout.batch.RolloutBatch` whose ``logp_mu`` are the engine's behavior
    log-probs (the rollout path: trajectories, left-padded prompts, right-padded responses)."""
    from trainer.engines.base import SamplingParams
    from trainer.rollout.batch import to_batch
    from trainer.rollout.trajectory import Trajectory

    texts = ["Problem: 17*23?", "x", "A much longer prompt than the others, padded on the left.", "Tool: ",
             "What is 4817 * 392?", "hi there"]
    prompts = [tok.encode(t, add_special_tokens=False) for t in texts]
    obs = tok.encode("\n<interpreter>42</interpreter>\n", add_special_tokens=False)
    trs = [Trajectory(prompt_ids=p, sample_id=i, group_id=i) for i, p in enumerate(prompts)]
    for turn in range(2):
        params = SamplingParams(temperature=temperature, top_p=top_p, max_new_tokens=24, seed=seed + turn,
                                ignore_eos=True)
        outs = _generate(engine, [tr.prompt_ids + tr.response_ids for tr in trs], params)
        for tr, r in zip(trs, outs, strict=True):
            tr.append_model_tokens(r.token_ids, r.logprobs, 0)
            if turn == 0:
                tr.append_observation_tokens(obs)
    return to_batch(trs, tok.pad_token_id)


def step_logprob_parity(ctx: StepContext) -> dict:
    """Behavior log-probs from the embedded engine on the device vs the learner's recomputation
    (``trainer.learner.backends.torch.response_logprobs``, the torch backend's forward) of the same
    tokens by a separate copy of the weights on the device, over the same top-p support the engine
    sampled from (issue 46 item 1: both sides use the truncated, renormalised distribution).

    Reports, per dtype (float32, bfloat16) and sampling setting (T = 1; T = 0.7, top-p 0.9), the
    max and mean |Δ log-prob| over model tokens. Passes iff every float32 max is ≤ 1e-5 (the
    project's parity goal) and every bfloat16 mean is ≤ 0.05 (bf16 rounds logits to ~3 digits;
    the max is reported, not gated)."""
    import torch

    from trainer.engines.embedded import EmbeddedEngine, EmbeddedEngineConfig
    from trainer.learner.backends.torch import response_logprobs
    from trainer.learner.distributed.shard import batch_to
    from trainer.models.loading import load_model_and_tokenizer
    from trainer.models.tiny import TinyModelConfig, save_tiny_checkpoint

    dev = torch.device(ctx.device)
    ckpt = save_tiny_checkpoint(ctx.work / "tiny_parity", TinyModelConfig(hidden_size=64, seed=1))
    cases: dict[str, dict] = {}
    fails: list[str] = []
    for dtype_name in ("float32", "bfloat16"):
        dtype = getattr(torch, dtype_name)
        engine_model, tok = load_model_and_tokenizer(ckpt, dtype=dtype)
        learner_model = load_model_and_tokenizer(ckpt, dtype=dtype)[0].to(dev).eval()
        engine = EmbeddedEngine(engine_model, tok, EmbeddedEngineConfig(max_batch_size=8, device=str(dev)))
        try:
            for temperature, top_p in ((1.0, 1.0), (0.7, 0.9)):
                batch = parity_batch(engine, tok, temperature, top_p, seed=7)
                with torch.no_grad():
                    lp = response_logprobs(learner_model, batch_to(batch, dev), temperature,
                                           top_p=top_p).float().cpu()  # the sampler's support replayed
                mask = batch.loss_mask.bool()
                diff = (lp - batch.logp_mu)[mask].abs()
                key = f"{dtype_name}_T{temperature:g}_p{top_p:g}"
                cases[key] = {"max_abs_diff": float(diff.max()), "mean_abs_diff": float(diff.mean()),
                              "tokens": int(mask.sum()), "rows": len(batch),
                              "mean_logp_mu": float(batch.logp_mu[mask].mean())}
                ok = (cases[key]["max_abs_diff"] <= 1e-5 if dtype_name == "float32"
                      else cases[key]["mean_abs_diff"] <= 0.05)
                ok = ok and all(math.isfinite(v) for v in cases[key].values())
                if not ok:
                    fails.append(key)
        finally:
            asyncio.run(engine.close())
    fp32 = max(v["max_abs_diff"] for k, v in cases.items() if k.startswith("float32"))
    bf16 = max(v["max_abs_diff"] for k, v in cases.items() if k.startswith("bfloat16"))
    return {"status": "failed" if fails else "passed",
            "reason": f"over tolerance: {', '.join(fails)}" if fails else None, "cases": cases,
            "fp32_max_abs_diff": fp32, "bf16_max_abs_diff": bf16, "device": str(dev),
            "headline": f"max abs Δ log p: fp32 {fp32:.2e} (goal 1e-5), bf16 {bf16:.2e}",
            "details_md": ["| dtype, sampling | max abs Δ | mean abs Δ | tokens | mean log µ |",
                           "|---|---|---|---|---|",
                           *(f"| {k} | {v['max_abs_diff']:.2e} | {v['mean_abs_diff']:.2e} | {v['tokens']} | "
                             f"{v['mean_logp_mu']:.3f} |" for k, v in cases.items())]}


# -- 10-step run -------------------------------------------------------------------------------------
def run10_command(ctx: StepContext, out_dir: Path, sandbox: str) -> list[str]:
    """The ``copc train`` command line of the ``run10`` step (through ``gpu_check.py cli``)."""
    dist = "nccl" if ctx.device == "cuda" else "gloo"
    return [sys.executable, "-u", str(REPO / "scripts" / "gpu_check.py"), "cli", "--sandbox", sandbox, "--",
            "train", "--config", "configs/math_tool/cpu_tiny.yaml", f"train.total_steps={ctx.run_steps}",
            f"warm_start.steps={ctx.warm_start_steps}", f"eval.num_samples={ctx.eval_samples}", "eval.k=1",
            "logging.plots=false", "logging.tensorboard=false", "logging.progress=false",
            f"checkpoint.every_steps={ctx.run_steps}", "learner.backend=fsdp",
            "learner.backend_settings.world_size=1", f"learner.backend_settings.dist_backend={dist}",
            f"output_dir={out_dir}"]


def _read_json(path: Path) -> dict:
    return json.loads(path.read_text()) if path.is_file() else {}


def _read_jsonl(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _last(rows: list[dict], key: str) -> float | None:
    return next((r[key] for r in reversed(rows) if key in r), None)


def _finite_mean(rows: list[dict], key: str) -> float | None:
    vals = [r[key] for r in rows if isinstance(r.get(key), (int, float)) and math.isfinite(r[key])]
    return sum(vals) / len(vals) if vals else None


def step_run10(ctx: StepContext) -> dict:
    """``copc train --config configs/math_tool/cpu_tiny.yaml`` for ``ctx.run_steps`` RL steps with
    the learner on the device: ``learner.backend=fsdp learner.backend_settings.world_size=1`` (NCCL on
    CUDA; the only setting that puts a learner on the GPU — the torch backend and the embedded engine stay on
    the CPU in ``copc train``). Passes iff the run exits 0 having done every step with finite
    losses. The run's summary, metrics and config are archived."""
    sb = json.loads((ctx.work / "sandbox.json").read_text()) if (ctx.work / "sandbox.json").is_file() \
        else dict(zip(("isolation", "note"), probe_sandbox(), strict=True))
    out_dir = ctx.work / "run10"
    shutil.rmtree(out_dir, ignore_errors=True)
    cmd = run10_command(ctx, out_dir, sb["isolation"])
    print(" ".join(cmd), flush=True)
    t0 = time.perf_counter()
    try:
        rc = subprocess.run(cmd, cwd=REPO, timeout=max(10.0, ctx.left() - 3)).returncode
    except subprocess.TimeoutExpired:
        rc = None
    wall = time.perf_counter() - t0
    keep = ctx.artifacts / "run10"
    keep.mkdir(exist_ok=True)
    for name in ("summary.json", "metrics.jsonl", "config.yaml"):
        if (out_dir / name).is_file():
            shutil.copy(out_dir / name, keep / name)
    summary = _read_json(out_dir / "summary.json")
    train = [r for r in _read_jsonl(out_dir / "metrics.jsonl") if "perf/learner_step_s" in r]
    nonfinite = sum(1 for r in train for k in ("actor/pg_loss", "critic/value_loss")
                    if isinstance(r.get(k), float) and not math.isfinite(r[k]))
    ws, ev0, ev1 = (summary.get(k, {}) for k in ("warm_start", "eval_before", "eval_after"))
    res = {"returncode": rc, "wall_s_run": round(wall, 1), "sandbox": sb["isolation"],
           "sandbox_note": sb.get("note", ""), "learner": f"fsdp world 1 on {ctx.device}", "command": cmd[4:],
           "steps": summary.get("steps"), "episodes": summary.get("episodes"),
           "rl_wall_s": summary.get("rl_wall_s"), "sft_loss_first": ws.get("sft/loss_first"),
           "sft_loss_last": ws.get("sft/loss_last"), "eval_accuracy_before": ev0.get("accuracy"),
           "eval_accuracy_after": ev1.get("accuracy"), "eval_tool_call_rate_after": ev1.get("tool_call_rate"),
           "learner_step_s_mean": _finite_mean(train, "perf/learner_step_s"),
           "weight_sync_s_mean": _finite_mean(train, "perf/weight_sync_s"),
           "pg_loss_last": _last(train, "actor/pg_loss"), "nonfinite_losses": nonfinite,
           "value_loss_last": _last(train, "critic/value_loss")}
    ok = rc == 0 and summary.get("steps") == ctx.run_steps and nonfinite == 0
    why = None if ok else ("timeout" if rc is None else f"exit code {rc}, steps {summary.get('steps')}, "
                                                         f"non-finite losses {nonfinite}")
    res.update(status="passed" if ok else "failed", reason=why,
               headline=f"{summary.get('steps')} steps in {summary.get('wall_s', 0):.0f} s, learner step "
                        f"{res['learner_step_s_mean'] or 0:.2f} s, acc {ev0.get('accuracy')} → "
                        f"{ev1.get('accuracy')}, sandbox {sb['isolation']}")
    return res


def _learner(ctx: StepContext) -> dict:
    from gpu_check_learner import step_learner

    return step_learner(ctx)


STEP_FUNCTIONS: dict[str, Callable[[StepContext], dict]] = {
    "env": step_env, "pytest_gpu": step_pytest_gpu, "learner_steps": _learner,
    "logprob_parity": step_logprob_parity, "run10": step_run10}
