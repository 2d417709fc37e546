"""``copc train`` and ``copc eval`` with ``task.env: harness``: a real multi-turn tool agent written
against the ``openai`` client (two tools, three calls per episode) through 2 RL steps on the embedded
engine, a scripted tiny model with a Qwen-style chat template.

The learner is the torch backend with one hook added by a plugin (a learner registration): it saves
each batch and the log-probs it recomputes. Checked: the batch's model tokens are exactly the sampled
ids, the tool results and prompts are masked, the behaviour log-probs equal the learner's recomputed
ones (≤ 1e-5, tokens of the learner's version), rewards arrive; then ``copc eval`` plays the same
agent on the rows as a user benchmark.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from bpe_tokenizer import bpe_tokenizer
from chat_tokenizer import chat_tokenizer

from trainer.cli import main as cli_main
from trainer.evaluate.records import read_results
from trainer.models.tiny import TinyModelConfig, save_tiny_checkpoint

ROOT = Path(__file__).parent.resolve().parents[2]
TESTS = Path(__file__).parent.resolve().parent
ACTIONS = ['<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>',
           '<tool_call>\n{"name": "mul", "arguments": {"a": 5, "b": 5}}\n</tool_call>', "25"]

PLUGIN = f'''
import os, sys
import torch
sys.path.insert(0, {str(TESTS)!r})
from scripted import scripted
from trainer.engines import register_engine
from trainer.engines.builtin import embedded_engine
from trainer.learner import register_learner
from trainer.learner.backends.torch import TorchLearner

ACTIONS = {ACTIONS!r}


def turn_of(prompt_text):
    return min(prompt_text.count("<|im_start|>assistant\\n") - 1, len(ACTIONS) - 1)


def scripted_embedded(spec):
    handle = embedded_engine(spec)
    handle.engine.logits_processor = scripted(spec.tokenizer, ACTIONS, turn_of)
    return handle


class RecordingLearner(TorchLearner):
    def recompute(self, batch):
        logp_old, values = super().recompute(batch)
        torch.save({{"input_ids": batch.input_ids, "prompt_len": batch.prompt_len,
                    "loss_mask": batch.loss_mask,
                    "logp_mu": batch.logp_mu, "versions": batch.versions, "rewards": batch.rewards,
                    "logp_old": logp_old, "version": self.policy_version}},
                   os.path.join(os.environ["COPC_TEST_BATCHES"], f"step{{self.policy_version}}.pt"))
        return logp_old, values


register_engine("scripted_embedded", scripted_embedded, overwrite=True)
register_learner("recording", RecordingLearner.from_spec, overwrite=True)
'''


def check_saved_batches(batches: Path, model: str) -> None:
    """The recording learner's batches of steps 0 and 1 (2 episodes each): every model run is the
    scripted call's sampled ids exactly, the tool results and prompt are masked, the reward is
    1 + the tool bonus 0.1, and the behaviour log-probs equal the learner's (≤ 1e-5)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    want = [[*tok.encode(a, add_special_tokens=False), tok.eos_token_id] for a in ACTIONS]
    for v in (0, 1):
        b = torch.load(batches / f"step{v}.pt")
        assert b["input_ids"].shape[0] == 2
        P = b["prompt_len"]
        for row in range(2):
            ids, mask = b["input_ids"][row, P:].tolist(), b["loss_mask"][row].tolist()
            model_runs, cur = [], []
            for t, m in zip(ids, mask, strict=True):
                if m:
                    cur.append(t)
                elif cur:
                    model_runs.append(cur)
                    cur = []
            assert model_runs + ([cur] if cur else []) == want  # the sampled ids, exactly
            n = int(b["loss_mask"][row].sum())
            assert n == sum(len(w) for w in want)  # tool results (and the prompt) are masked
            text = tok.decode([t for t, m in zip(ids, mask, strict=True) if not m])
            assert "<tool_response>\n5\n</tool_response>" in text and "<tool_response>\n25\n" in text
            assert float(b["rewards"][row].sum()) == pytest.approx(1.1)  # correct 1 + tool bonus 0.1
        fresh = (b["versions"] == b["version"]) & b["loss_mask"].bool()
        assert fresh.any()
        assert (b["logp_old"] - b["logp_mu"])[fresh].abs().max().item() <= 1e-5


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    d = tmp_path_factory.mktemp("harness_train")
    model = save_tiny_checkpoint(d / "model",
                                 TinyModelConfig(hidden_size=32, intermediate_size=64, num_layers=1),
                                 tokenizer=chat_tokenizer(bpe_tokenizer()))
    (d / "plugin.py").write_text(PLUGIN)
    data = d / "data"
    data.mkdir()
    rows = [{"id": f"q{i}", "problem": f"What is (2+3)*5? ({i})", "answer": "25"} for i in range(6)]
    (data / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[:4]))
    (data / "eval.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[4:]))
    return {"dir": d, "model": str(model), "plugin": str(d / "plugin.py"), "data": data}


def _overrides(setup) -> list[str]:
    agent = str(TESTS / "harness_agent.py") + ":run"
    return [f"plugins=[{setup['plugin']}]", f"model.path={setup['model']}", "task.env=harness",
            f"task.data_dir={setup['data']}", "task.train_data=[train.jsonl]", "task.eval_data=[eval.jsonl]",
            f"task.env_kwargs={{agent: '{agent}', timeout_s: 120}}", "rollout.engine=scripted_embedded",
            "rollout.max_new_tokens=64", "rollout.max_total_tokens=1024", "rollout.max_turns=6",
            "rollout.concurrency=2", "logging.progress=false", "logging.tensorboard=false",
            "logging.plots=false"]


def test_train_two_steps_then_eval(setup, tmp_path, monkeypatch):
    batches = tmp_path / "batches"
    batches.mkdir()
    monkeypatch.setenv("COPC_TEST_BATCHES", str(batches))
    out = tmp_path / "run"
    assert cli_main(["train", "--config", str(ROOT / "configs/examples/calc_tiny.yaml"), *_overrides(setup),
                     "learner.backend=recording", f"output_dir={out}", "train.total_steps=2",
                     "train.prompts_per_step=2", "train.micro_batch_size=2",
                     "train.staleness={mode: fixed, lag: 0}", "eval.num_samples=2"]) == 0
    check_saved_batches(batches, setup["model"])
    summary = json.loads((out / "summary.json").read_text())
    assert (summary["task"], summary["steps"], summary["episodes_trained"], summary["infra_failed"]) == \
        ("harness", 2, 4, 0)
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    rewards = [m["rollout/reward_mean"] for m in metrics if "rollout/reward_mean" in m]
    assert rewards == [pytest.approx(1.1)] * 2

    # copc eval: the same agent on the rows, as a user benchmark on the config's environment
    ev = tmp_path / "eval"
    assert cli_main(["eval", "--model", setup["model"], "--benchmarks",
                     f"{setup['data'] / 'eval.jsonl'}:harness:math", "--k", "1", "--out", str(ev),
                     *_overrides(setup)]) == 0
    records = read_results(ev / "results.jsonl")
    assert len(records) == 2 and all(r["correct"] and not r["failed"] for r in records)
    assert all(r["score_components"] == {"correct": 1.0, "tool_bonus": 0.1} for r in records)
    report = json.loads((ev / "report.json").read_text())["benchmarks"]["eval"]
    assert report["avg@1"] == 1.0 and report["failed_episodes"] == 0
