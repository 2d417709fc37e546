"""``copc train`` with ``learner.backend=megatron`` (TP = 2 on 2 gloo ranks) end to end, and resume
after SIGKILL: same step count, no repeated prompts, identical next-step loss from the checkpoint.
Real processes (the driver, its spawned ranks, the bwrap sandbox) on 2 CPU cores."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch

from trainer.config import load_config
from trainer.config.specs import learner_spec
from trainer.learner import make_learner, restore_learner
from trainer.outputs.checkpoint import CheckpointManager
from trainer.rollout.batch import RolloutBatch, to_batch
from trainer.rollout.trajectory import Trajectory

REPO = Path(__file__).parent.resolve().parents[2]
CONFIG = "configs/math_tool/cpu_tiny.yaml"
pytestmark = pytest.mark.slow

KILL_SCRIPT = """
import sys
from trainer.config import load_config
from trainer.app.run import run_experiment
run_experiment(load_config("configs/math_tool/cpu_tiny.yaml", sys.argv[2:]), resume=sys.argv[1] == "resume")
"""


def train_overrides(out: Path, steps: int, *extra: str) -> list[str]:
    return [f"output_dir={out}", "learner.backend=megatron", "learner.backend_settings.world_size=2",
            "learner.backend_settings.tensor_parallel_size=2", "learner.backend_settings.timeout_s=300",
            f"train.total_steps={steps}",
            "train.prompts_per_step=2", "train.micro_batch_size=2", "train.critic_warmup_steps=0",
            "model.tiny.hidden_size=32", "model.tiny.intermediate_size=64", "model.tiny.num_layers=1",
            "rollout.max_new_tokens=12", "rollout.max_turns=2", "rollout.concurrency=4",
            "warm_start.enabled=false", "eval.enabled=false", "logging.progress=false", "logging.plots=false",
            "logging.tensorboard=false", "checkpoint.every_steps=1", "checkpoint.keep_last=2", *extra]


def trained_steps(out: Path) -> list[int]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [r["step"] for r in rows if "actor/pg_loss" in r]


def small_batch(n: int = 4) -> RolloutBatch:
    """Behavior log-probs ≈ log(1/258): the tiny model is near-uniform, so COPC's policy channel
    keeps the tokens (a µ far off would mask them all and make the loss 0)."""
    g = torch.Generator().manual_seed(1)
    trs = []
    for i in range(n):
        tr = Trajectory(prompt_ids=[40 + i, 41], sample_id=i, group_id=i)
        tr.append_model_tokens(torch.randint(0, 255, (4 + i,), generator=g).tolist(), [-5.55] * (4 + i), 0)
        tr.reward = float(i % 2)
        trs.append(tr)
    return to_batch(trs, 0)


def test_copc_train_megatron_tp2_runs_end_to_end(tmp_path):
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "trainer.cli", "train", "--config", CONFIG, *train_overrides(out, 3)]
    res = subprocess.run(cmd, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True,
                         text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 3 and summary["duplicate_trained_uids"] == 0
    assert trained_steps(out) == [1, 2, 3]
    ckpts = CheckpointManager(out / "checkpoints")
    latest = ckpts.latest()
    assert CheckpointManager.step_of(latest) == 3
    for model in ("actor", "critic"):  # Megatron dist_checkpointing, one shard file per rank and model
        assert (latest / "learner_shards" / model / ".metadata").is_file()
    state = ckpts.load(keys=["learner"])
    assert state["learner"]["backend"] == "megatron" and state["learner"]["policy_version"] == 3
    assert state["learner"]["tensor_parallel_size"] == 2


def test_megatron_resume_after_sigkill_same_steps_no_repeated_prompts_same_next_step_loss(tmp_path):
    out = tmp_path / "run"
    args = train_overrides(out, 6)
    script = tmp_path / "job.py"
    script.write_text(KILL_SCRIPT)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen([sys.executable, str(script), "fresh", *args], cwd=REPO, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    ckpts = CheckpointManager(out / "checkpoints")
    deadline = time.monotonic() + 400
    while True:  # kill the driver once step >= 2 is checkpointed, in the middle of later work
        latest = ckpts.latest()
        if latest is not None and CheckpointManager.step_of(latest) >= 2:
            break
        assert proc.poll() is None, proc.stderr.read()[-3000:]
        assert time.monotonic() < deadline, "no checkpoint in time"
        time.sleep(0.05)
    ranks = [c.pid for c in psutil.Process(proc.pid).children(recursive=True)]
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    killed_at = CheckpointManager.step_of(ckpts.latest())
    assert killed_at < 6, "the run finished before it could be killed; make it longer"
    deadline = time.monotonic() + 30  # the orphaned ranks notice their parent is gone and exit
    while any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE for p in ranks):
        assert time.monotonic() < deadline, "learner ranks outlived the killed driver"
        time.sleep(0.2)

    # the checkpoint the resume starts from gives the same next-step loss in two fresh rank groups
    cfg = load_config(CONFIG, args)
    losses = []
    for _ in range(2):
        with make_learner(learner_spec(cfg), out / "init_model") as lrn:
            restore_learner(lrn, ckpts.load())
            assert lrn.policy_version == killed_at
            losses.append(lrn.step(small_batch())["actor/pg_loss"])
    assert losses[0] == losses[1] and losses[0] != 0.0

    res = subprocess.run([sys.executable, str(script), "resume", *args], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 6
    assert summary["trained_uids"] == 12 and summary["duplicate_trained_uids"] == 0
    uids = ckpts.load(keys=["trained_uids"])["trained_uids"]
    assert len(uids) == len(set(uids)) == 12
    assert trained_steps(out) == [1, 2, 3, 4, 5, 6]
