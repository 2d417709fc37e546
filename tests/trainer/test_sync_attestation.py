"""Weight-sync attestation (``train.sync_check_tolerance``) with a real embedded engine and a real
torch learner on a tiny transformers model: an honest sync passes every step with the engine's and
the learner's probe log-probs equal; a sync that keeps the old weights, or the old version, stops
the run with one line naming the version."""

from __future__ import annotations

import asyncio
import copy
import dataclasses

import pytest
from test_loop_learner import SAMPLES, EchoEnv, Recorder

import copc
from trainer.config import ConfigError, load_config
from trainer.engines.base import SamplingParams
from trainer.engines.embedded import EmbeddedEngine
from trainer.errors import TrainingError
from trainer.learner.backends.torch import TorchLearner
from trainer.learner.settings import LearnerConfig, OptimizerSettings
from trainer.models.loading import load_model_and_tokenizer
from trainer.models.tiny import TinyModelConfig, save_tiny_checkpoint
from trainer.orchestration.attestation import SyncCheck
from trainer.orchestration.loop import AsyncTrainingLoop, BoundedAdmission, FixedLag, LoopConfig
from trainer.orchestration.prompts import PromptStream
from trainer.orchestration.rollouts import LocalRollouts, engine_handle
from trainer.rollout.agent_loop import AgentLoopConfig


class ParityEnv(EchoEnv):
    """Reward 1 when the response's first character has an even code: about half the episodes,
    so the advantages are not all 0 and the actor moves every step."""

    def score(self, sample, response, answer, tool_calls):
        return float(bool(response) and ord(response[0]) % 2 == 0), {}


@pytest.fixture(scope="module")
def tiny_small(tmp_path_factory):
    return str(save_tiny_checkpoint(tmp_path_factory.mktemp("tiny_sync"),
                                    TinyModelConfig(hidden_size=32, intermediate_size=64, num_layers=1)))


def _run(path, *, sync: str = "honest", staleness=None, tolerance: float = 1e-4, steps: int = 3):
    actor, tok = load_model_and_tokenizer(path)
    engine_model = copy.deepcopy(actor)
    initial = {k: v.clone() for k, v in actor.state_dict().items()}
    learner = TorchLearner(actor, copc.get_preset("copc"), LearnerConfig(
        optim=OptimizerSettings(actor_lr=1e-2, critic_lr=1e-2), micro_batch_size=4))
    hooks = Recorder()

    async def main():
        eng = EmbeddedEngine(engine_model, tok)
        handle = engine_handle(eng)

        async def stale_weights(weights, version):  # loads the initial weights as the new version
            await eng.update_weights(initial, version)

        async def no_sync(weights, version):
            return None

        handle = {"honest": handle, "stale_weights": dataclasses.replace(handle, sync=stale_weights),
                  "no_sync": dataclasses.replace(handle, sync=no_sync)}[sync]
        rollouts = LocalRollouts(handle, ParityEnv, tok, SamplingParams(max_new_tokens=6, seed=0),
                                 AgentLoopConfig(max_turns=1), 4)
        loop = AsyncTrainingLoop(
            learner, rollouts, PromptStream(SAMPLES, 0),
            LoopConfig(total_steps=steps, prompts_per_step=2, n_samples_per_prompt=2,
                       pad_token_id=tok.pad_token_id, staleness=staleness or BoundedAdmission(1),
                       sync_check=SyncCheck(tolerance, 1.0, tok.pad_token_id)), hooks)
        try:
            await loop.run()
        finally:
            await rollouts.close()
            await eng.close()

    asyncio.run(main())
    return hooks.seen


def test_an_honest_sync_is_attested_every_step(tiny_small):
    seen = _run(tiny_small)
    assert [m["step"] for m in seen] == [1, 2, 3]
    # version n's check runs while batch n + 1 is awaited and is reported with step n + 1
    assert "sync/probe_max_abs_logp_diff" not in seen[0]
    diffs = [m["sync/probe_max_abs_logp_diff"] for m in seen[1:]]
    assert len(diffs) == 2 and all(0.0 <= d <= 1e-5 for d in diffs), diffs
    assert all(m["actor/grad_norm"] > 0 for m in seen)  # the policy moved: the check compared new weights
    assert all(m["perf/sync_check_wait_s"] >= 0.0 for m in seen)  # its cost is measured by runs, not here


def test_a_sync_that_keeps_the_old_weights_stops_the_run_naming_the_version(tiny_small):
    with pytest.raises(TrainingError) as ei:
        _run(tiny_small, sync="stale_weights")
    msg = str(ei.value)
    assert msg.startswith("weight sync check failed: after the sync the engine log-probs differ by ")
    assert "at policy version 1 (train.sync_check_tolerance=0.0001)" in msg and "\n" not in msg


def test_the_last_version_is_checked_too(tiny_small):
    with pytest.raises(TrainingError, match="at policy version 1 "):
        _run(tiny_small, sync="stale_weights", steps=1)


def test_a_sync_that_never_happens_is_another_version(tiny_small):
    with pytest.raises(TrainingError, match="engine reported another policy version than policy version 1"):
        _run(tiny_small, sync="no_sync")


def test_fixed_lag_is_not_attested(tiny_small):
    """The producer syncs a kept copy of version n − k there, which the learner no longer holds."""
    seen = _run(tiny_small, sync="stale_weights", staleness=FixedLag(1), steps=2)
    assert [m["step"] for m in seen] == [1, 2]
    assert all("sync/probe_max_abs_logp_diff" not in m for m in seen)


def test_the_tolerance_is_validated_in_one_line():
    with pytest.raises(ConfigError, match=r"train\.sync_check_tolerance=0.*must be a number > 0"):
        load_config("configs/math_tool/cpu_tiny.yaml", ["train.sync_check_tolerance=0"])
    assert load_config("configs/math_tool/cpu_tiny.yaml", ["train.sync_check_tolerance=null"]
                       ).train.sync_check_tolerance is None
    with pytest.raises(ValueError, match=r"train\.sync_check_tolerance=-1"):
        SyncCheck(-1)
