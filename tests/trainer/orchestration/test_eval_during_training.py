"""Evaluation during training (``eval.every_steps``) in the real asynchronous loop (tiny model,
embedded engine, torch learner): called between batches on the policy version of that step, its
metrics in that step's row, a failing evaluation logged and training going on; and ``copc train``
with it (records per step, eval/policy_version in metrics.jsonl)."""

from __future__ import annotations

import asyncio
import copy
import json

import pytest

import copc
from trainer.config import ConfigError, load_config
from trainer.engines.base import SamplingParams
from trainer.engines.embedded import EmbeddedEngine
from trainer.learner.backends.torch import TorchLearner
from trainer.learner.settings import LearnerConfig
from trainer.models.loading import load_model_and_tokenizer
from trainer.models.tiny import TinyModelConfig, save_tiny_checkpoint
from trainer.orchestration.loop import AsyncTrainingLoop, BoundedAdmission, LoopConfig
from trainer.orchestration.prompts import PromptStream
from trainer.orchestration.rollouts import LocalRollouts, engine_handle
from trainer.rollout.agent_loop import AgentLoopConfig

from .test_loop_learner import SAMPLES, EchoEnv, Recorder


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return str(save_tiny_checkpoint(tmp_path_factory.mktemp("tiny_eval"),
                                    TinyModelConfig(hidden_size=32, intermediate_size=64, num_layers=1)))


class EvalHooks(Recorder):
    """Records each evaluation's step and the engine's version at that moment; fails on demand."""

    def __init__(self, engine, fail_at=()):
        super().__init__()
        self.engine, self.fail_at, self.calls = engine, set(fail_at), []

    async def evaluate(self, step):
        self.calls.append((step, self.engine.version))
        if step in self.fail_at:
            raise RuntimeError("retriever down")
        out = await self.engine.generate([5, 6, 7], SamplingParams(max_new_tokens=3, seed=step))
        return {"eval/accuracy": 0.5, "eval/policy_version": float(out.versions[0])}


def _run(path, every, steps, fail_at=()):
    actor, tok = load_model_and_tokenizer(path)
    learner = TorchLearner(actor, copc.get_preset("copc"), LearnerConfig(micro_batch_size=4))

    async def main():
        eng = EmbeddedEngine(copy.deepcopy(actor), tok)
        hooks = EvalHooks(eng, fail_at)
        rollouts = LocalRollouts(engine_handle(eng), EchoEnv, tok, SamplingParams(max_new_tokens=4, seed=0),
                                 AgentLoopConfig(max_turns=1), 4)
        loop = AsyncTrainingLoop(learner, rollouts, PromptStream(SAMPLES, 0),
                                 LoopConfig(total_steps=steps, prompts_per_step=2, n_samples_per_prompt=1,
                                            pad_token_id=tok.pad_token_id, staleness=BoundedAdmission(1),
                                            eval_every=every), hooks)
        await loop.run()
        await rollouts.close()
        await eng.close()
        return hooks

    return asyncio.run(main())


def test_every_n_steps_on_that_steps_policy_version(tiny):
    hooks = _run(tiny, every=2, steps=5)
    assert hooks.calls == [(2, 2), (4, 4)]  # not after the last step: the after-RL evaluation does it
    rows = {m["step"]: m for m in hooks.seen}
    assert sorted(rows) == [1, 2, 3, 4, 5]
    for s in (2, 4):
        assert rows[s]["eval/policy_version"] == float(s) and rows[s]["eval/accuracy"] == 0.5
        assert rows[s]["perf/eval_s"] >= 0
    assert all("eval/accuracy" not in rows[s] for s in (1, 3, 5))


def test_a_failing_evaluation_is_logged_and_training_goes_on(tiny):
    hooks = _run(tiny, every=1, steps=3, fail_at={1})
    rows = {m["step"]: m for m in hooks.seen}
    assert sorted(rows) == [1, 2, 3]
    assert rows[1]["eval/failed"] == 1.0 and "eval/accuracy" not in rows[1]
    assert rows[2]["eval/accuracy"] == 0.5 and "eval/failed" not in rows[2]


def test_every_steps_is_validated_and_off_by_default():
    assert load_config("configs/math_tool/cpu_tiny.yaml").eval.every_steps == 0
    with pytest.raises(ConfigError, match=r"eval\.every_steps=-1.*must be an int >= 0"):
        load_config("configs/math_tool/cpu_tiny.yaml", ["eval.every_steps=-1"])


def test_copc_train_logs_the_curve(tmp_path):
    """The real run (cpu_tiny math, bounded staleness): held-out evaluations at step 1 and 2 of 3,
    records under eval/, rows with eval/policy_version = the step."""
    from trainer.cli import main as cli_main

    out = tmp_path / "run"
    rc = cli_main(["train", "--config", "configs/math_tool/cpu_tiny.yaml", "train.total_steps=3",
                   "eval.every_steps=1", "eval.num_samples=4", "train.staleness={mode: bounded, max: 1}",
                   "warm_start.enabled=false", "logging.progress=false", f"output_dir={out}"])
    assert rc == 0
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    during = {r["step"]: r for r in rows if "eval/policy_version" in r}
    assert sorted(during) == [1, 2]
    assert all(during[s]["eval/policy_version"] == s and during[s]["eval/n"] == 4 for s in during)
    assert (out / "eval" / "step_1.jsonl").exists() and (out / "eval" / "step_2.jsonl").exists()
