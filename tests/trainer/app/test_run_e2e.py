"""End-to-end ``run_experiment``: few-step runs per preset, checkpoint + resume after SIGKILL."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from trainer.app.run import run_experiment
from trainer.config import load_config
from trainer.outputs.checkpoint import CheckpointManager

REPO = Path(__file__).parent.resolve().parents[2]


def overrides(out: Path, preset: str, steps: int = 3, **extra: str) -> list[str]:
    base = {
        "preset": preset, "output_dir": str(out),
        "model.tiny.hidden_size": "32", "model.tiny.intermediate_size": "64", "model.tiny.num_layers": "1",
        "task.env": "math_tool", "task.train_data": "[math_train]", "task.max_train_samples": "40",
        "task.env_kwargs": "{prompt_template: 'Q: {problem}\n'}",
        "train.total_steps": str(steps), "train.prompts_per_step": "2", "train.micro_batch_size": "4",
        "train.actor_lr": "1e-4", "train.critic_lr": "1e-3", "train.staleness.max": "2",
        "rollout.max_new_tokens": "12", "rollout.max_turns": "2", "rollout.max_total_tokens": "1024",
        "rollout.concurrency": "4", "rollout.n_samples_per_prompt": "2" if preset == "dapo" else "1",
        "eval.enabled": "false", "warm_start.enabled": "false", "logging.progress": "false",
        "checkpoint.every_steps": "1", "checkpoint.keep_last": "2",
    }
    base.update(extra)
    return [f"{k}={v}" for k, v in base.items()]


@pytest.mark.parametrize("preset,bound", [("copc", 2), ("ppo", 0), ("dapo", 2)])
def test_few_step_run_per_preset(tmp_path, preset, bound):
    cfg = load_config(None, overrides(tmp_path / preset, preset))
    summary = run_experiment(cfg)
    assert summary["steps"] == 3 and summary["duplicate_trained_uids"] == 0
    assert summary["trained_uids"] == 6
    rows = [json.loads(line) for line in (tmp_path / preset / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "actor/pg_loss" in r]
    assert [r["step"] for r in steps] == [1, 2, 3]
    for r in steps:
        # the histogram is counts per staleness level: nothing beyond the bound
        assert r["staleness/max"] <= bound and len(r["staleness/hist"]) - 1 <= bound
        assert sum(r["staleness/hist"]) > 0
        assert all(math.isfinite(v) for v in r.values() if isinstance(v, float))
        # where rollout time went (sums over the step's episodes): the model and the sandbox both took some
        assert r["time/rollout_llm_s"] > 0 and r["time/rollout_env_s"] > 0 and r["time/rollout_other_s"] >= 0
    ckpt = CheckpointManager(tmp_path / preset / "checkpoints")
    assert CheckpointManager.step_of(ckpt.latest()) == 3
    assert (tmp_path / preset / "summary.json").exists()
    assert any(p.endswith(".png") for p in summary.get("plots", []))
    assert any(p.endswith("rollout_time.png") for p in summary["plots"])


KILL_SCRIPT = """
import sys
from trainer.config import load_config
from trainer.app.run import run_experiment
run_experiment(load_config(None, sys.argv[2:]), resume=sys.argv[1] == "resume")
"""


def test_resume_after_sigkill_same_steps_no_duplicate_prompts(tmp_path):
    out = tmp_path / "run"
    args = overrides(out, "copc", steps=6)
    script = tmp_path / "job.py"
    script.write_text(KILL_SCRIPT)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen([sys.executable, str(script), "fresh", *args], cwd=REPO, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    ckpts = CheckpointManager(out / "checkpoints")
    deadline = time.monotonic() + 300
    while True:  # kill it once it has checkpointed step >= 2, in the middle of later work
        latest = ckpts.latest()
        if latest is not None and CheckpointManager.step_of(latest) >= 2:
            break
        assert proc.poll() is None, proc.stderr.read()
        assert time.monotonic() < deadline, "no checkpoint in time"
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    killed_at = CheckpointManager.step_of(ckpts.latest())
    assert killed_at < 6, "the run finished before it could be killed; make it longer"
    res = subprocess.run([sys.executable, str(script), "resume", *args], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 6
    assert summary["trained_uids"] == 12 and summary["duplicate_trained_uids"] == 0
    state = ckpts.load()
    uids = state["trained_uids"]
    assert len(uids) == len(set(uids)) == 12
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "actor/pg_loss" in r] == [1, 2, 3, 4, 5, 6]


def test_resume_of_a_finished_run_changes_nothing(tmp_path):
    cfg = load_config(None, overrides(tmp_path / "r", "copc", steps=2))
    first = run_experiment(cfg)
    before = (tmp_path / "r" / "summary.json").read_text()
    lines = (tmp_path / "r" / "metrics.jsonl").read_text()
    again = run_experiment(cfg, resume=True)
    assert again["episodes"] == first["episodes"] and again["steps"] == 2
    assert (tmp_path / "r" / "summary.json").read_text() == before
    assert (tmp_path / "r" / "metrics.jsonl").read_text() == lines


def test_start_up_errors_name_the_key(tmp_path):
    from trainer.app.run import run_evaluation
    from trainer.config import ConfigError

    with pytest.raises(ConfigError, match=r"output_dir=.*no checkpoint, warm-start or initial model"):
        run_evaluation(load_config(None, overrides(tmp_path / "typo", "copc")))
    with pytest.raises(ConfigError, match=r"--checkpoint='/nonexistent': no such directory"):
        run_evaluation(load_config(None, overrides(tmp_path / "x", "copc")), checkpoint="/nonexistent")
    with pytest.raises(ConfigError, match=r"rollout\.engine='sglang' needs a CUDA GPU"):
        run_experiment(load_config(None, overrides(tmp_path / "sg", "copc",
                                                   **{"rollout.engine": "sglang"})))


def test_resume_continues_every_cumulative_counter(tmp_path):
    """Issue 9 fault 10: a checkpoint that recorded 3 stale drops must not restart them at 0."""
    out = tmp_path / "c"
    first = run_experiment(load_config(None, overrides(out, "copc", steps=2)))
    ckpts = CheckpointManager(out / "checkpoints", keep_last=2)
    state = ckpts.load()
    counters = state["loop"]["counters"]
    assert counters["episodes_trained"] == 4 and counters["episodes"] == first["episodes"] >= 4
    counters.update(dropped_stale=3, infra_failed=2, infra_failed_groups=1)  # as if they had happened
    state["loop"]["counters"] = counters
    ckpts.save(2, state)
    wall_before = state["summary"]["wall_s_before_resume"]
    assert wall_before > 0
    resumed = run_experiment(load_config(None, overrides(out, "copc", steps=4)), resume=True)
    assert resumed["steps"] == 4 and resumed["episodes_trained"] == 8
    assert resumed["dropped_stale"] >= 3 and resumed["infra_failed"] == 2
    assert resumed["episodes"] >= counters["episodes"] + 4
    assert resumed["tokens_trained"] > counters["tokens_trained"]
    assert resumed["wall_s"] > wall_before
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = {r["step"]: r for r in rows if "actor/pg_loss" in r}
    assert sorted(steps) == [1, 2, 3, 4]
    assert steps[3]["rollout/dropped_stale"] >= 3 and steps[3]["rollout/infra_failed"] == 2
    assert steps[3]["rollout/episodes_trained_total"] == 6 and steps[4]["rollout/episodes_trained_total"] == 8
    totals = [steps[s]["rollout/episodes_total"] for s in (1, 2, 3, 4)]
    assert totals == sorted(totals)  # never restarts
    assert steps[4]["rollout/dropped_stale"] == resumed["dropped_stale"]


def test_bad_env_setting_is_rejected_at_load_naming_the_key(tmp_path):
    """Issue 9 fault 1: a typo in task.env_kwargs used to kill every rollout task and hang."""
    from trainer.config import ConfigError

    for extra, needle in [({"task.env_kwargs": "{reward: {mode: math-verify}}"},
                           "task.env_kwargs.reward.mode='math-verify': must be one of"),
                          ({"task.env_kwargs": "{max_turn: 3}"},
                           "task.env_kwargs.max_turn: not a setting of env 'math_tool'"),
                          ({"task.env_kwargs": "{limits: {max_turns: 0}}"},
                           "task.env_kwargs.limits.max_turns=0: must be an int >= 1"),
                          ({"task.env_kwargs": "{limits: 5}"},
                           "task.env_kwargs.limits=5: must be a mapping of EnvLimits fields"),
                          ({"task.env_kwargs": "{code_memory_mb: -5}"},
                           "task.env_kwargs.code_memory_mb=-5: must be an int >= 64 (MiB)"),
                          ({"task.env_kwargs": "{reward: {correct_reward: abc}}"},
                           "task.env_kwargs.reward.correct_reward='abc': must be a number"),
                          ({"task.env_kwargs": "{prompt_template: 'Q {problem} {'}"},
                           "task.env_kwargs.prompt_template='Q {problem} {': not a str.format template"),
                          ({"task.env_kwargs": "{dataset: no_such_set.jsonl}"},
                           "task.env_kwargs.dataset: env 'math_tool' could not load its data")]:
        cfg = load_config(None, overrides(tmp_path / "bad", "copc", **extra))
        t0 = time.monotonic()
        with pytest.raises(ConfigError) as ei:
            run_experiment(cfg)
        assert needle in str(ei.value) and time.monotonic() - t0 < 60


def test_cli_bad_env_setting_exits_2_with_one_line(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    res = subprocess.run([sys.executable, "-m", "trainer.cli", "train", "--config",
                          "configs/math_tool/cpu_tiny.yaml", "warm_start.enabled=false", "eval.enabled=false",
                          f"output_dir={tmp_path / 'o'}",
                          "task.env_kwargs.reward.mode=math-verify"], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 2, res.stderr[-2000:]
    lines = res.stderr.strip().splitlines()
    assert lines[-1] == ("copc train: config error: task.env_kwargs.reward.mode='math-verify': "
                         "must be one of ('math_verify', 'dapo_strict')")
    assert "Traceback" not in res.stderr


def test_resume_skips_a_torn_checkpoint_and_refuses_when_none_is_intact(tmp_path, capsys, caplog):
    """``copc train --resume`` through the real CLI (issue 21 item 13): the newest checkpoint torn
    (its learner file cut short) → one warning naming it, the run resumes from the previous one
    and trains the missing steps; every checkpoint torn → one line naming the directory, exit 2."""
    from trainer.cli import main as cli_main

    out = tmp_path / "run"
    args = overrides(out, "copc", steps=3, **{"checkpoint.keep_last": "3"})
    args = ["--config", str(REPO / "configs/base.yaml"), *args]
    assert cli_main(["train", *args]) == 0
    ckdir = out / "checkpoints"
    newest = ckdir / "step_00000003" / "learner.pt"
    newest.write_bytes(newest.read_bytes()[:100])
    with caplog.at_level("WARNING"):
        assert cli_main(["train", *args, "--resume"]) == 0
    assert any("skipping torn checkpoint" in r.getMessage() and "step_00000003" in r.getMessage()
               for r in caplog.records)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "actor/pg_loss" in r][-1] == 3  # step 3 trained again
    assert CheckpointManager(ckdir).problem(ckdir / "step_00000003") is None  # rewritten intact
    for d in ckdir.glob("step_*"):
        (d / "loop.pt").write_bytes(b"x")
    capsys.readouterr()
    assert cli_main(["train", *args, "--resume"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"{ckdir}: none of its 3 checkpoint(s) is intact" in err[0], err
