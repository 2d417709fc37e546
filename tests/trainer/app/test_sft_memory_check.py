"""The warm-start's memory check (issue 45, item 4): mixed precision counted against torch's own
saved tensors, a warm-start that cannot fit refused before its first step naming
``warm_start.micro_batch_size``, and the estimate against a real warm-start's peak RSS."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from trainer.app.memory_check import check_sft_memory, sft_memory_plan
from trainer.config import ConfigError, load_config
from trainer.models.memory_estimate import GIB, MachineMemory, MemoryPlan, ModelDims, _layer_bytes_per_token
from trainer.models.tiny import TinyModelConfig, build_tiny_model

ROOT = Path(__file__).resolve().parents[3]
MATH = ROOT / "configs" / "math_tool" / "cpu_smollm.yaml"


def _saved_bytes(model: torch.nn.Module, ids: torch.Tensor, autocast: bool) -> int:
    """Bytes of the distinct storages autograd saves in the decoder's forward (parameters excluded)."""
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), \
            torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        model.get_decoder()(input_ids=ids)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    return sum(v for k, v in seen.items() if k not in params)


@pytest.mark.usefixtures("one_torch_thread")
@pytest.mark.parametrize("autocast", [False, True])
def test_layer_activations_match_what_autograd_saves(autocast):
    """A 4-layer Llama-style model (float32 weights), 2 rows x 96 tokens: the estimate's kept layer
    activations (float32: ``8h + 3kv + 4i`` elements at 4 bytes; mixed precision: the float32 and
    bf16 counts plus the bf16 weight copies) are within 10 % of the bytes autograd really saves."""
    cfg = TinyModelConfig(arch="llama", hidden_size=128, intermediate_size=384, num_layers=4, num_heads=4,
                          num_kv_heads=2, seed=0)
    model = build_tiny_model(cfg, 512, 1, 0).train()
    dims = ModelDims(vocab=512, hidden=128, intermediate=384, layers=4, heads=4, kv_heads=2)
    b, t = 2, 96
    measured = _saved_bytes(model, torch.randint(2, 512, (b, t)), autocast)
    plan = MemoryPlan(dims=dims, act_bytes=4, mixed_precision=autocast, micro_batch=b, seq_len=t)
    counted = b * t * _layer_bytes_per_token(plan) * dims.layers
    if autocast:  # and the bf16 copy of every layer weight (embeddings are not cast)
        counted += 2 * (dims.params - dims.vocab * dims.hidden)
    print(f"measured / counted {measured / counted:.3f}")
    assert 0.9 <= measured / counted <= 1.1, (measured, counted)


def test_a_warm_start_that_cannot_fit_is_refused_naming_the_micro_batch(realmodel_path):
    """The math main job's warm-start (16 traces of its longest, 641 tokens) is estimated near its
    measured 17-18 GiB without micro-batches; on a 16 GiB machine it is refused in one line naming
    the largest ``warm_start.micro_batch_size`` that fits; with the config's micro-batch of 4 it fits."""
    whole = load_config(MATH, [f"model.path={realmodel_path}", "warm_start.micro_batch_size=0"])
    est = check_sft_memory(whole, 16, 641, MachineMemory(24 * GIB, 24 * GIB, "test"))
    assert 16 * GIB < est.total < 20 * GIB, est.line()
    with pytest.raises(ConfigError) as e:
        check_sft_memory(whole, 16, 641, MachineMemory(16 * GIB, 16 * GIB, "test"))
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("memory: the warm-start needs ~")
    assert "16 traces x 641 tokens" in msg
    fix = int(msg.split("change: warm_start.micro_batch_size=")[1].split()[0])  # the largest that fits
    fits = [check_sft_memory(whole, m, 641, MachineMemory(64 * GIB, 64 * GIB, "test")).total < 16 * GIB
            for m in (fix, fix + 1)]
    assert 1 < fix < 16 and fits == [True, False], (fix, fits)
    cfg = load_config(MATH, [f"model.path={realmodel_path}"])
    assert cfg.warm_start.micro_batch_size == 4
    assert check_sft_memory(cfg, 4, 641, MachineMemory(16 * GIB, 16 * GIB, "test")).total < 8 * GIB
    off = load_config(MATH, [f"model.path={realmodel_path}", "warm_start.micro_batch_size=0",
                             "learner.memory_check=false"])
    assert check_sft_memory(off, 16, 641, MachineMemory(GIB, GIB, "test")).total == est.total
    plan = sft_memory_plan(cfg, 4, 641)
    assert plan.mixed_precision and plan.param_bytes == 4 and not plan.critic and plan.engines == 0


def test_copc_train_refuses_a_warm_start_that_cannot_fit_naming_its_micro_batch(tmp_path):
    """``copc train`` wires the check into the warm-start: a tiny model made wide (hidden 1024, 8
    layers) with 512 traces in one forward needs ~90 GiB, so the run exits 2 with one line after
    generating its traces and before any SFT step; with ``warm_start.micro_batch_size=256`` the
    line names 256 traces per forward (the setting reaches the SFT)."""
    base = ["--config", "configs/math_tool/cpu_tiny.yaml", "warm_start.num_examples=512",
            "warm_start.batch_size=512", "model.tiny.hidden_size=1024", "model.tiny.intermediate_size=4096",
            "model.tiny.num_layers=8", "eval.enabled=false", "logging.progress=false"]
    for extra, rows in (([], 512), (["warm_start.micro_batch_size=256"], 256)):
        proc = subprocess.run([sys.executable, "-m", "trainer.cli", "train", *base, *extra,
                               f"output_dir={tmp_path / str(rows)}"],
                              cwd=ROOT, capture_output=True, text=True, timeout=600)
        lines = [x for x in proc.stderr.splitlines() if x.startswith("copc train:")]
        assert proc.returncode == 2 and len(lines) == 1, proc.stderr[-2000:]
        assert "memory: the warm-start needs ~" in lines[0] and f"({rows} traces x " in lines[0], lines[0]
        assert "change: warm_start.micro_batch_size=" in lines[0]
        assert not (tmp_path / str(rows) / "warm_start_model").exists()


def test_estimate_is_within_25_percent_of_a_real_warm_starts_peak_rss(realmodel_path):
    """Two warm-start steps of SmolLM2 (4 traces of 320 tokens, micro-batches of 2, bf16 autocast on
    float32 weights), the SFT memory benchmark's own child process: its peak RSS is within 25 % of
    the estimate. Measured: docs/models.md ("The memory estimate")."""
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_sft_memory.py"), "--child", "2",
                           "--model", str(realmodel_path), "--rows", "4", "--tokens", "320", "--steps", "2"],
                          cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-2000:]
    row = json.loads(proc.stdout.strip().splitlines()[-1])
    assert row["tokens"] == 320
    cfg = load_config(MATH, [f"model.path={realmodel_path}"])
    est = check_sft_memory(cfg, 2, row["tokens"], MachineMemory(64 * GIB, 64 * GIB, "test")).total
    print(f"estimate {est / GIB:.2f} GiB, measured peak RSS {row['peak_rss'] / GIB:.2f} GiB")
    assert 0.75 <= row["peak_rss"] / est <= 1.25, (est / GIB, row["peak_rss"] / GIB)


def test_a_warm_start_that_cannot_fit_is_refused_before_the_copy_drills_run(tmp_path):
    """The search tiny job runs copy drills (batch 32, which fit) before its warm-start: a warm-start
    of 512 traces in one forward on a wide model (~90 GiB) is refused in one line before the drills'
    own check, i.e. before any SFT step, not after minutes of drills (was: after them)."""
    proc = subprocess.run([sys.executable, "-m", "trainer.cli", "train",
                           "--config", "configs/search/cpu_tiny.yaml", "warm_start.num_examples=512",
                           "warm_start.batch_size=512",
                           "model.tiny.hidden_size=1024", "model.tiny.intermediate_size=4096",
                           "model.tiny.num_layers=8", "eval.enabled=false", "logging.progress=false",
                           f"output_dir={tmp_path / 'run'}"],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    lines = [x for x in proc.stderr.splitlines() if x.startswith("copc train:")]
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr[-2000:]
    assert "memory: the warm-start needs ~" in lines[0] and "(512 traces x " in lines[0], lines[0]
    assert "copy-drill warm-start memory estimate" not in proc.stderr
    assert not (tmp_path / "run" / "warm_start_model").exists()


def test_no_warm_start_traces_is_the_sft_error_not_a_max_of_nothing():
    """A task that made no traces: the warm-start raises ``sft_warm_start: traces is empty`` (as
    before the memory check moved ahead of the drills), not ``max() arg is an empty sequence``."""
    from trainer.app.context import _train_warm_start

    cfg = load_config(ROOT / "configs" / "math_tool" / "cpu_tiny.yaml")
    with pytest.raises(ValueError, match=r"^sft_warm_start: traces is empty$"):
        _train_warm_start(cfg, None, None, None, [], None)
