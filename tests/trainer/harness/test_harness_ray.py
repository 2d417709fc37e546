"""``task.env: harness`` under the Ray launcher: the same multi-turn ``openai``-client agent as
``test_harness_train`` (two tools, three calls per episode), its episodes played in a Ray rollout
worker against that worker's own endpoint and engine, through ``copc train`` for 2 RL steps.

Checked as for the local run (``check_saved_batches``): every trained episode is the agent's (3 model
calls, the scripted ids exactly, tool results masked), its rewards (1 + tool bonus 0.1) arrive, and
the behaviour log-probs equal the learner's recomputed ones (≤ 1e-5, tokens of the learner's
version).
"""

from __future__ import annotations

import json

import pytest
from bpe_tokenizer import bpe_tokenizer
from chat_tokenizer import chat_tokenizer

from trainer.cli import main as cli_main
from trainer.models.tiny import TinyModelConfig, save_tiny_checkpoint

from .test_harness_train import PLUGIN, TESTS, check_saved_batches

ray = pytest.importorskip("ray")
ROOT = TESTS.parents[1]


@pytest.fixture(scope="module")
def batches(request, tmp_path_factory):
    """Where the recording learner saves its batches, and a local 2-CPU Ray cluster started after
    ``COPC_TEST_BATCHES`` names it (the learner actor gets the environment Ray started with)."""
    d = tmp_path_factory.mktemp("ray_batches")
    mp = pytest.MonkeyPatch()
    mp.setenv("COPC_TEST_BATCHES", str(d))
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    request.addfinalizer(mp.undo)
    request.addfinalizer(ray.shutdown)
    return d


def test_harness_episodes_play_in_a_ray_worker(batches, tmp_path):
    model = save_tiny_checkpoint(tmp_path / "model",
                                 TinyModelConfig(hidden_size=32, intermediate_size=64, num_layers=1),
                                 tokenizer=chat_tokenizer(bpe_tokenizer()))
    (tmp_path / "ray_harness_plugin.py").write_text(PLUGIN)  # a stem of its own: one process
    data = tmp_path / "data"
    data.mkdir()
    rows = [{"id": f"q{i}", "problem": f"What is (2+3)*5? ({i})", "answer": "25"} for i in range(4)]
    (data / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "run"
    agent = str(TESTS / "harness_agent.py") + ":run"
    assert cli_main([
        "train", "--config", str(ROOT / "configs/examples/calc_tiny.yaml"),
        f"plugins=[{tmp_path / 'ray_harness_plugin.py'}]",
        f"model.path={model}", "task.env=harness", f"task.data_dir={data}", "task.train_data=[train.jsonl]",
        "task.eval_data=[]", f"task.env_kwargs={{agent: '{agent}', timeout_s: 120}}",
        "rollout.engine=scripted_embedded", "rollout.max_new_tokens=64", "rollout.max_total_tokens=1024",
        "rollout.max_turns=6", "rollout.concurrency=2", "logging.progress=false", "logging.tensorboard=false",
        "logging.plots=false", "learner.backend=recording", f"output_dir={out}", "train.total_steps=2",
        "train.prompts_per_step=2", "train.micro_batch_size=2", "train.staleness={mode: fixed, lag: 0}",
        "eval.enabled=false", "launcher.kind=ray", "launcher.settings.num_rollout_workers=1"]) == 0
    check_saved_batches(batches, str(model))  # the worker's episodes, exactly as the local run's
    summary = json.loads((out / "summary.json").read_text())
    assert (summary["steps"], summary["episodes_trained"], summary["infra_failed"]) == (2, 4, 0)
