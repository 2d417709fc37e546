"""The prepared GPU check (scripts/gpu_check.sh, docs/gpu_check.md), exercised on CPU.

The slow test runs the whole script in ``--device cpu`` mode (gloo, the same steps) with a small
budget and checks the summary it leaves: every step passed, the runs that need CUDA are
reported as skipped with that reason, the learner runs match the fp32 reference within their
tolerances (and the bf16 ones differ from it, so the comparison is not vacuous), the log-prob
parity meets 1e-5 in fp32, the short run did its steps through the ``process`` sandbox fallback,
and ``$OUT`` fits what the device machine returns (≤ 8 files, ≤ 2 folders deep). The fast tests
cover the wheel installer, the budget arithmetic, a failing and a timed-out step, and the
metric comparison on hand-made numbers.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
SCRIPTS = REPO / "scripts"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod  # dataclasses look their module up there
    sys.path.insert(0, str(SCRIPTS))  # gpu_check_steps imports gpu_check_learner by name
    try:
        spec.loader.exec_module(mod)
    finally:
        sys.path.remove(str(SCRIPTS))
    return mod


gpu_check = _load("gpu_check")
learner_check = _load("gpu_check_learner")


def _env(**extra: str) -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "GPU_CHECK_PYTHON": sys.executable, **extra}


@pytest.mark.slow
def test_cpu_mode_runs_every_step_and_writes_the_summary(tmp_path):
    out = tmp_path / "out"
    proc = subprocess.run(["bash", "scripts/gpu_check.sh", "--budget-s", "400", "--run-steps", "3",
                           "--warm-start-steps", "10"], cwd=REPO, capture_output=True, text=True, timeout=600,
                          env=_env(GPU_CHECK_DEVICE="cpu", OUT=str(out), TMPDIR=str(tmp_path),
                                   GPU_CHECK_SANDBOX="process"))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    s = json.loads((out / "gpu_check_summary.json").read_text())
    assert s["schema"] == 1 and s["device_requested"] == "cpu" and s["ok"] is True
    assert s["device_name"] == "cpu" and s["torch"] == torch.__version__ and s["python"]
    assert list(s["steps"]) == ["env", "pytest_gpu", "learner_steps", "logprob_parity", "run10"]
    for name, step in s["steps"].items():
        assert step["status"] == "passed", (name, step.get("reason"))
        assert step["wall_s"] > 0 and step["log"].startswith("logs/") and (out / step["log"]).is_file()
        assert isinstance(step["headline"], str) and step["headline"]
    assert s["wall_s"] < 400

    pt = s["steps"]["pytest_gpu"]  # no CUDA here: the gpu-marked tests are collected and skipped
    assert pt["tests"] >= 1 and pt["skipped"] == pt["tests"] and pt["failures"] == pt["errors"] == 0
    assert "tests/trainer/engines/test_sglang.py" in pt["files"]

    runs = s["steps"]["learner_steps"]["runs"]
    assert set(runs) == {f"{b}_{d}" for b in ("torch", "fsdp", "megatron") for d in ("bf16", "fp32")}
    mb = runs["megatron_bf16"]
    assert mb["status"] == "skipped" and mb["reason"].startswith("needs CUDA")
    assert runs["torch_fp32"]["status"] == "skipped"
    ref = s["steps"]["learner_steps"]["reference"]["metrics"]
    assert len(ref) == 2 and all(abs(m["actor/grad_norm"]) > 0.1 for m in ref)
    for name in ("fsdp_fp32", "megatron_fp32"):
        r = runs[name]
        assert r["status"] == "passed" and r["max_scaled_key"] <= 1e-4 and r["weights_max_abs_diff"] <= 1e-4
        assert len(r["steps"]) == 2 and set(r["steps"][0]) == set(learner_check.KEY_METRICS)
    tb = runs["torch_bf16"]  # refused by design: full fine-tuning of bf16 weights (a ConfigError)
    assert tb["status"] == "skipped" and "ConfigError" in tb["reason"]
    # bf16 mixed precision really differs from fp32, within its tolerance
    assert 1e-5 < runs["fsdp_bf16"]["max_scaled_key"] <= 2e-2, runs["fsdp_bf16"]
    assert runs["megatron_fp32"]["optimizer"].startswith("torch AdamW")

    par = s["steps"]["logprob_parity"]
    assert par["fp32_max_abs_diff"] <= 1e-5 and len(par["cases"]) == 4
    assert all(c["tokens"] == 6 * 48 and c["mean_logp_mu"] < -1.0 for c in par["cases"].values())

    r10 = s["steps"]["run10"]
    assert r10["steps"] == 3 and r10["sandbox"] == "process" and r10["nonfinite_losses"] == 0
    assert r10["sft_loss_last"] < r10["sft_loss_first"] and r10["learner_step_s_mean"] > 0
    assert "learner.backend=fsdp" in r10["command"]
    assert "learner.backend_settings.dist_backend=gloo" in r10["command"]

    files = [p for p in out.rglob("*") if p.is_file()]
    assert len(files) <= 8 and all(len(p.relative_to(out).parts) <= 3 for p in files)
    md = (out / "gpu_check_summary.md").read_text()
    assert "# GPU check — OK (cpu)" in md and all(f"| {n} | passed" in md for n in s["steps"])


def test_a_failing_step_is_recorded_and_the_next_still_runs(tmp_path):
    """``--device cuda`` without CUDA: env and logprob_parity fail, each with its reason and log."""
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, str(SCRIPTS / "gpu_check.py"), "run", "--device", "cuda", "--out",
                           str(out), "--work", str(tmp_path / "w"), "--steps", "logprob_parity"],
                          cwd=REPO, capture_output=True, text=True, timeout=300,
                          env=_env(CUDA_VISIBLE_DEVICES="", PYTHONPATH=str(REPO)))
    assert proc.returncode == 1, proc.stdout + proc.stderr
    s = json.loads((out / "gpu_check_summary.json").read_text())
    assert list(s["steps"]) == ["env", "logprob_parity"] and s["ok"] is False
    assert s["steps"]["env"]["status"] == "failed"
    assert s["steps"]["env"]["reason"] == "--device cuda but torch sees no CUDA device"
    par = s["steps"]["logprob_parity"]
    assert par["status"] == "failed" and "Error" in par["reason"] and par["log_tail"]
    assert "FAILURES" in (out / "gpu_check_summary.md").read_text()


def test_a_step_past_its_timeout_is_killed_and_recorded(tmp_path):
    args = argparse.Namespace(device="cpu", run_steps=1, warm_start_steps=1, eval_samples=1)
    (tmp_path / "logs").mkdir()
    res = gpu_check.run_step(gpu_check.STEPS[2], args, tmp_path, tmp_path / "logs", timeout_s=1.0)
    assert res["status"] == "failed" and res["reason"] == "timeout after 1 s" and res["wall_s"] < 30
    assert res["log"] == "logs/learner_steps.log"


def test_step_timeouts_keep_the_later_steps_reserves():
    reserves = [s.reserve_s for s in gpu_check.STEPS]
    assert gpu_check.step_timeout(0, 450) == gpu_check.STEPS[0].cap_s
    # 100 s left before learner_steps: it gets 100 − (20 + 60) = 20 s, the rest stays reserved
    assert gpu_check.step_timeout(2, 100) == pytest.approx(100 - reserves[3] - reserves[4])
    assert gpu_check.step_timeout(4, 30) == 30  # the last step gets what is left, up to its cap
    assert sum(s.cap_s for s in gpu_check.STEPS) > 450  # caps alone would overrun: the budget binds


def _wheel(dirpath: Path, filename: str, module: str) -> Path:
    name, version = filename.split("-")[:2]
    p = dirpath / filename
    with zipfile.ZipFile(p, "w") as z:
        z.writestr(f"{module}/__init__.py", "VALUE = 42\n")
        z.writestr(f"{name}-{version}.dist-info/METADATA",
                   f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
        z.writestr(f"{name}-{version}.data/purelib/{module}_extra.py", "X = 1\n")
    return p


def test_install_unpacks_only_missing_distributions_with_fitting_tags(tmp_path):
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    _wheel(wheels, "gpu_check_probe_a-1.0-py3-none-any.whl", "gpu_check_probe_a")
    _wheel(wheels, "gpu_check_probe_b-2.0-cp27-cp27mu-manylinux1_x86_64.whl", "gpu_check_probe_b")
    _wheel(wheels, "pytest-0.1-py3-none-any.whl", "pytest_fake")  # pytest is installed here
    rep = gpu_check.install_wheels(wheels, tmp_path / "site")
    assert rep["installed"] == {"gpu-check-probe-a": "1.0"}
    assert rep["no_compatible_wheel"] == ["gpu-check-probe-b"]
    assert rep["present"]["pytest"] == pytest.__version__
    site = tmp_path / "site"
    assert (site / "gpu_check_probe_a" / "__init__.py").read_text() == "VALUE = 42\n"
    assert (site / "gpu_check_probe_a_extra.py").is_file() and not list(site.glob("*.data"))
    assert not (site / "pytest_fake").exists()
    assert gpu_check.wheel_tags("psutil-7.2.2-cp36-abi3-manylinux2010_x86_64.manylinux_2_12_x86_64.whl") == (
        "psutil", "7.2.2", {"cp36-abi3-manylinux2010_x86_64", "cp36-abi3-manylinux_2_12_x86_64"})
    with pytest.raises(ValueError, match=r"not-a-wheel\.zip"):
        gpu_check.wheel_tags("not-a-wheel.zip")


def test_compare_scales_differences_and_gates_key_metrics():
    w = {"lm_head.weight": torch.zeros(2)}
    ref = {"metrics": [{"actor/pg_loss": -0.5, "actor/grad_norm": 4.0, "advantage/mean": 0.1,
                        "perf/x": 9.0}], "weights": w}
    got = {"metrics": [{"actor/pg_loss": -0.49, "actor/grad_norm": 4.2, "advantage/mean": 0.4,
                        "perf/x": 1.0}], "weights": {"lm_head.weight": torch.tensor([0.0, -0.25])}}
    c = learner_check.compare(ref, got, tol=2e-2)
    # |Δ| / max(1, |ref|): pg_loss 0.01 / 1, grad_norm 0.2 / 4 = 0.05 > 2e-2
    assert c["steps"][0]["actor/pg_loss"]["scaled"] == pytest.approx(0.01)
    assert c["max_scaled_key"] == pytest.approx(0.05) and c["within_tolerance"] is False
    assert c["max_abs_other_key"] == "advantage/mean" and c["max_abs_other"] == pytest.approx(0.3)
    assert c["weights_max_abs_diff"] == 0.25
    assert learner_check.compare(ref, got, tol=0.06)["within_tolerance"] is True
    got["metrics"][0]["actor/grad_norm"] = float("nan")
    assert learner_check.compare(ref, got, tol=1.0)["within_tolerance"] is False
