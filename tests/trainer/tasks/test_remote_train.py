"""``copc train`` with ``task.env: remote`` against ``copc env serve --env math_tool``: CPU-tiny
math, a supervised warm start on traces played on the server, then 2 RL steps; every episode is
played on the server (its session count grows, none is left open) and none fails."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from environments.remote.launch import start_env_server
from trainer.config import ConfigError, load_config
from trainer.config.specs import task_spec
from trainer.tasks import build_task

REPO = Path(__file__).parent.resolve().parents[2]
PROMPT = 'prompt_template="Q: {problem}\\n"'  # a YAML double-quoted value: \n is a newline


@pytest.fixture(scope="module")
def math_server():
    server = start_env_server("math_tool", PROMPT, "reward.mode=dapo_strict")
    yield server
    server.stop()


def overrides(out: Path, url: str) -> list[str]:
    cfg = {
        "output_dir": str(out), "preset": "copc",
        "model.tiny.hidden_size": "32", "model.tiny.intermediate_size": "64", "model.tiny.num_layers": "1",
        "task.env": "remote", "task.env_kwargs": f"{{url: '{url}', remote_env: math_tool}}",
        "task.max_train_samples": "40", "task.max_eval_samples": "4",
        "task.settings.arithmetic_kinds": "[mul]",
        "train.total_steps": "2", "train.prompts_per_step": "2", "train.micro_batch_size": "4",
        "train.staleness.max": "1", "train.torch_threads": "1",
        "rollout.max_new_tokens": "12", "rollout.max_turns": "2", "rollout.max_total_tokens": "1024",
        "rollout.concurrency": "4", "rollout.n_samples_per_prompt": "1",
        "warm_start.enabled": "true", "warm_start.kind": "retool_arithmetic", "warm_start.num_examples": "8",
        "warm_start.steps": "2", "warm_start.batch_size": "4",
        "eval.enabled": "false", "logging.progress": "false", "checkpoint.every_steps": "1",
    }
    return [f"{k}={v}" for k, v in cfg.items()]


def test_copc_train_on_a_served_math_tool_env(tmp_path, math_server):
    config = tmp_path / "remote.yaml"
    config.write_text("name: remote_math_tiny\n")
    out = tmp_path / "run"
    before = httpx.get(f"{math_server.url}/sessions").json()["opened_total"]
    res = subprocess.run([sys.executable, "-m", "trainer.cli", "train", "--config", str(config),
                          *overrides(out, math_server.url)], cwd=REPO, capture_output=True, text=True,
                         timeout=900, env={**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"})
    assert res.returncode == 0, res.stderr[-4000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 2 and summary["trained_uids"] == 4
    assert summary["warm_start"]["sft/traces"] == 8 and summary["infra_failed"] == 0
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "actor/pg_loss" in r]
    assert [r["step"] for r in steps] == [1, 2]
    assert steps[-1]["rollout/infra_failed"] == 0 and steps[-1]["rollout/episodes_total"] >= 4
    stats = httpx.get(f"{math_server.url}/sessions").json()
    # 8 warm-start traces, the settings check and >= 4 RL episodes, each its own session
    assert stats["opened_total"] - before >= 8 + 4
    assert stats["active_sessions"] == 0


def test_remote_task_config_errors_name_the_key(math_server):
    def task(kwargs: str):
        return build_task(task_spec(load_config(None, ["task.env=remote", f"task.env_kwargs={kwargs}"])))

    with pytest.raises(ConfigError, match=r"task.env_kwargs.url: required for task.env=remote"):
        task("{}")
    with pytest.raises(ConfigError, match=r"task.env_kwargs.prompt_template: not a setting of env 'remote'"):
        task(f"{{url: '{math_server.url}', prompt_template: x}}")
    with pytest.raises(ConfigError, match=r"task.env_kwargs.url='http://127.0.0.1:1': no OpenEnv server "):
        task("{url: 'http://127.0.0.1:1', retries: 0}")
    with pytest.raises(ConfigError, match=r"RemoteEnvConfig.remote_env='search': the server .* 'math_tool'"):
        task(f"{{url: '{math_server.url}', remote_env: search}}")
    t = task(f"{{url: '{math_server.url}'}}")  # the served id comes from the server
    try:
        assert t.served_env == "math_tool" and type(t.delegate).__name__ == "MathToolTask"
        assert t.info["remote_stop_strings"] == ["</code>"] and len(t.train_samples) == 2000
        env = t.make_env()
        assert env.reset(options={"sample": t.train_samples[0]})[0].startswith("Q: What is ")
        env.close()
    finally:
        t.close()
