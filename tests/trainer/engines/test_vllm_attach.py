"""``rollout.engine_settings.url``: runs attached to a vLLM server they did not start (issue 43 item 6,
"one shared server"), here the test session's shared server (``conftest.vllm_tiny_server``: tiny
Qwen2, float32, LoRA on, weights reloadable), started as a user would start it (the command an
attach refusal quotes):

- two ``copc train`` runs (LoRA, fixed lag 2) attach to it one after the other, while an adapter of
  someone else's is loaded on it under the name a launched run would give its first adapter: both
  runs finish with every sync attested (the start-up check included), their adapters carry
  run-unique names, none of theirs is left loaded afterwards and the other adapter still is;
- every attach refusal is one line quoting the command that starts a suitable server.

On a server without weight reloads (test_vllm.py's): the start-up check catching a server that
holds other weights, and the refusal of a full-weight run.
"""

from __future__ import annotations

import json
import logging
import os
import re
from pathlib import Path

import httpx
import pytest

from trainer.app.run import run_experiment
from trainer.config import load_config
from trainer.engines.vllm_launcher import (
    DEFAULT_VLLM_PYTHON,
    VLLMLaunchError,
)
from trainer.models.loading import load_model_and_tokenizer
from trainer.models.lora import AdapterWeights, LoraSettings, inject_lora
from trainer.models.tiny import save_tiny_checkpoint

from .conftest import VLLM_TINY

REPO = Path(__file__).resolve().parents[3]
HAVE_VLLM = os.access(DEFAULT_VLLM_PYTHON, os.X_OK)
pytestmark = [pytest.mark.vllm, pytest.mark.slow,
              pytest.mark.skipif(not HAVE_VLLM, reason=f"no vLLM venv at {DEFAULT_VLLM_PYTHON}: "
                                 "create it with `bash scripts/setup.sh --vllm`")]
OTHER = "copc-0-v0"  # the name a launched run gives its first adapter: held by "another user"


@pytest.fixture(scope="module")
def shared(vllm_tiny_server):
    """(url, model dir, server log) of the session's shared server, with another user's adapter loaded
    on it as ``OTHER`` for this module (unloaded after)."""
    url, ckpt = vllm_tiny_server.url, vllm_tiny_server.model
    model, _ = load_model_and_tokenizer(ckpt)
    lora = LoraSettings(rank=8, alpha=16.0, target_modules=("q_proj", "v_proj"))
    other = AdapterWeights.of(inject_lora(model, lora), lora).save_peft_dir(ckpt.parent / "other", ckpt)
    r = httpx.post(url + "/v1/load_lora_adapter", json={"lora_name": OTHER, "lora_path": str(other)},
                   timeout=60)
    assert r.status_code == 200, r.text
    yield url, ckpt, vllm_tiny_server.log
    httpx.post(url + "/v1/unload_lora_adapter", json={"lora_name": OTHER}, timeout=60)


def _config(out: Path, url: str, model: Path, *extra: str, lora: bool = True):
    """cpu_tiny.yaml on the model ``model`` served at ``url``: LoRA rank 8 (or full weights), fixed
    lag 2, 3 steps."""
    over = {
        "output_dir": str(out), "model.path": str(model), "warm_start.enabled": "false",
        "eval.enabled": "false", "logging.progress": "false", "logging.plots": "false",
        "rollout.engine": "vllm",
        "rollout.engine_settings": f"{{url: '{url}', max_model_len: 1024}}",
        **({"learner.lora.rank": "8"} if lora else {}), "train.total_steps": "3",
        "train.prompts_per_step": "2",
        "train.micro_batch_size": "4", "train.critic_warmup_steps": "0",
        "train.staleness": "{mode: fixed, lag: 2}", "train.sync_check_tolerance": "1e-4",
        "task.env_kwargs.reward": "{mode: dapo_strict, incorrect_reward: -1.0}",
        "rollout.max_new_tokens": "16", "rollout.concurrency": "4",
    }
    return load_config(str(REPO / "configs/math_tool/cpu_tiny.yaml"), [f"{k}={v}" for k, v in over.items()]
                       + list(extra))


def _served(url: str) -> list[str]:
    return sorted(m["id"] for m in httpx.get(url + "/v1/models", timeout=30).json()["data"])


def test_two_runs_attach_one_after_the_other_and_leave_the_server_as_they_found_it(shared, tmp_path, caplog):
    url, model, log = shared
    caplog.set_level(logging.INFO, logger="trainer.orchestration")
    prefixes = []
    for run in ("a", "b"):
        before = log.read_text()
        summary = run_experiment(_config(tmp_path / run, url, model))
        assert summary["steps"] == 3 and summary["episodes_trained"] == 6
        assert "engine checked at start-up: policy version 0" in caplog.text
        assert "weight syncs up to the final version 3 attested" in caplog.text
        rows = [json.loads(x) for x in (tmp_path / run / "metrics.jsonl").read_text().splitlines()]
        assert max(r.get("sync/probe_max_abs_logp_diff", 0.0) for r in rows) <= 1e-4
        loaded = re.findall(r"Loaded new LoRA adapter: name '(copc-[0-9a-f]{6}-)\d+-v\d+'",
                            log.read_text()[len(before):])
        assert loaded and len(set(loaded)) == 1, loaded  # one run-unique prefix per run
        # on attach: the extension's ping, then the reload of the start weights
        assert log.read_text()[len(before):].count('"POST /collective_rpc HTTP/1.1" 200') == 2
        prefixes.append(loaded[0])
        assert not (tmp_path / run / "vllm_server.log").exists()  # the server's log is not the run's
        assert _served(url) == sorted([OTHER, "policy"])  # its adapters unloaded, the other one kept
        caplog.clear()
    assert prefixes[0] != prefixes[1]


def test_attach_refusals_are_one_line_with_the_command(shared, tmp_path):
    url, model, _ = shared
    other = save_tiny_checkpoint(tmp_path / "elsewhere", VLLM_TINY)
    cases = [
        (_config(tmp_path / "r1", "http://127.0.0.1:9", model), "no vLLM server answers"),
        (_config(tmp_path / "r2", url, other), f"serves {model}, but this run's model is {other}"),
    ]
    for cfg, expected in cases:
        with pytest.raises(VLLMLaunchError) as ei:
            run_experiment(cfg)
        msg = str(ei.value)
        assert msg.startswith(f"rollout.engine_settings.url={cfg.rollout.engine_settings['url']}: ")
        assert expected in msg and "\n" not in msg, msg
        command = msg.split("; start one with: ")[1]  # what starts a server this run could attach to
        assert f"--model {model if 'r2' not in str(cfg.output_dir) else other} " in command
        assert "--served-model-name policy" in command and "--logprobs-mode processed_logprobs" in command
        assert "--enable-lora --max-lora-rank 8" in command

