"""Failures in the async loop: never a hang, never a reward of 0, counters that survive resume.

Real components: a tiny transformers model in the embedded engine, a pure-Python tool env, the
real :class:`AsyncTrainingLoop` and :class:`TorchLearner`.
"""

from __future__ import annotations

import asyncio
import copy
import threading

import pytest

import copc
from environments.errors import InfrastructureError
from trainer.engines.base import SamplingParams
from trainer.engines.embedded import EmbeddedEngine
from trainer.learner.backends.torch import TorchLearner
from trainer.learner.settings import LearnerConfig, OptimizerSettings
from trainer.models.loading import load_model_and_tokenizer
from trainer.models.tiny import TinyModelConfig, save_tiny_checkpoint
from trainer.orchestration.loop import (
    COUNTERS,
    AsyncTrainingLoop,
    BoundedAdmission,
    LoopConfig,
    LoopState,
    TrainingError,
)
from trainer.orchestration.prompts import PromptStream
from trainer.orchestration.rollouts import LocalRollouts, engine_handle
from trainer.rollout.agent_loop import AgentLoopConfig

from .test_loop_learner import SAMPLES, EchoEnv, Recorder


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return str(save_tiny_checkpoint(tmp_path_factory.mktemp("tiny_fail"),
                                    TinyModelConfig(hidden_size=32, intermediate_size=64, num_layers=1)))


class FlakyEnv(EchoEnv):
    """EchoEnv whose ``step`` raises ``InfrastructureError`` for chosen sample ids.

    ``fail_times[id]`` is how many more times that sample fails (shared across env instances).
    """

    def __init__(self, fail_times: dict[str, int], lock: threading.Lock) -> None:
        super().__init__()
        self.fail_times, self.lock = fail_times, lock

    def step(self, action):
        sid = self._ep.sample["id"]
        with self.lock:
            left = self.fail_times.get(sid, 0)
            if left:
                self.fail_times[sid] = left - 1
        if left:
            raise InfrastructureError(f"sandbox for {sid} did not start")
        return super().step(action)


class RowFailsAfter(LocalRollouts):
    """Local rollouts whose prompt draws from ``4`` on raise (a bug in a rollout task)."""

    async def run_group(self, uid, sample, n):
        if uid >= 4:  # the first two steps train, then every rollout task raises
            raise KeyError("bad row")
        return await super().run_group(uid, sample, n)


def _loop(path, make_env, *, steps=3, per_step=2, n=1, s=1, rollouts_cls=LocalRollouts, learner_step=None,
          counters=None, frac=0.5, start_step=0, checkpoints=None, engine_version=None):
    actor, tok = load_model_and_tokenizer(path)
    learner = TorchLearner(actor, copc.get_preset("copc"),
                           LearnerConfig(
                               optim=OptimizerSettings(actor_lr=1e-3, critic_lr=1e-3), micro_batch_size=4))
    learner.steps_done = start_step  # as if restored from a checkpoint of that step
    if learner_step is not None:
        learner.step = learner_step
    eng = EmbeddedEngine(copy.deepcopy(actor), tok,
                         version=start_step if engine_version is None else engine_version)
    hooks = Recorder(checkpoints)
    rollouts = rollouts_cls(engine_handle(eng), make_env, tok, SamplingParams(max_new_tokens=4, seed=0),
                            AgentLoopConfig(max_turns=1), 4)
    loop = AsyncTrainingLoop(
        learner, rollouts, PromptStream(SAMPLES, 0),
        LoopConfig(total_steps=steps, prompts_per_step=per_step, n_samples_per_prompt=n,
                   pad_token_id=tok.pad_token_id, staleness=BoundedAdmission(s), checkpoint_every=100,
                   max_infra_failure_fraction=frac),
        hooks, LoopState(step=start_step, counters=counters or {}))
    return loop, eng, hooks.seen


async def _run(loop, eng, timeout_s=120.0):
    try:
        await asyncio.wait_for(loop.run(), timeout_s)
    finally:
        await loop.rollouts.close()
        await eng.close()


def test_exception_in_a_rollout_task_stops_the_run_and_checkpoints_first(tiny):
    """Issue 9 fault 1: an exception escaping a rollout task used to hang training forever."""
    checkpoints: list = []
    loop, eng, seen = _loop(tiny, EchoEnv, steps=10, s=0, rollouts_cls=RowFailsAfter, checkpoints=checkpoints)
    with pytest.raises(TrainingError, match=r"rollout of prompt draw \d+ failed: KeyError: 'bad row'.*"
                                            r"state after step 2 is checkpointed") as ei:
        asyncio.run(_run(loop, eng))
    assert isinstance(ei.value.__cause__, KeyError)
    assert [m["step"] for m in seen] == [1, 2]
    # the state after the last good step is on disk (checkpoint_every=100 would not have saved it)
    assert [st for st, _ in checkpoints] == [2]
    state = checkpoints[0][1]
    assert state["step"] == 2 and state["counters"]["episodes_trained"] == 4
    # the prompts admitted but not trained are re-queued in the saved state (none lost)
    assert set(state["prompts"]["requeued"]) >= {4, 5}


def test_exception_in_the_learner_propagates_without_hanging(tiny):
    def bad_step(batch):
        raise RuntimeError("CUDA error: an illegal memory access")

    loop, eng, _ = _loop(tiny, EchoEnv, learner_step=bad_step)
    with pytest.raises(TrainingError, match=r"^learner step 1 failed: RuntimeError: CUDA error: an illegal "
                                            r"memory access; no checkpoint yet$") as ei:
        asyncio.run(_run(loop, eng))
    assert isinstance(ei.value.__cause__, RuntimeError)


class BuggyEnv(EchoEnv):
    """An env whose reward code has a bug (raises TypeError, not InfrastructureError)."""

    def score(self, sample, response, answer, tool_calls):
        return "1" + 0.0, {}


def test_a_bug_in_the_environment_stops_the_run_instead_of_being_dropped(tiny):
    loop, eng, seen = _loop(tiny, BuggyEnv, steps=3)
    with pytest.raises(TrainingError, match=r"the environment raised on prompt draw \d+ \(sample 's\d+'\): "
                                            r"env_error: TypeError: can only concatenate str"):
        asyncio.run(_run(loop, eng))
    assert seen == []


def test_a_flaky_sandbox_below_the_limit_does_not_stop_the_run(tiny):
    """One episode in five fails (20 %), far below the 50 % limit: the run completes."""
    count = {"n": 0}
    lock = threading.Lock()

    class OneInFive(EchoEnv):
        def step(self, action):
            with lock:
                count["n"] += 1
                fail = count["n"] % 5 == 0
            if fail:
                raise InfrastructureError("sandbox worker died")
            return super().step(action)

    loop, eng, seen = _loop(tiny, OneInFive, steps=4, per_step=5, s=2, frac=0.5)
    asyncio.run(_run(loop, eng))
    assert [m["step"] for m in seen] == [1, 2, 3, 4]
    assert 4 <= loop.counters["infra_failed"] <= count["n"] // 5


def test_infra_failed_episodes_are_not_trained_counted_and_requeued(tiny):
    """An episode ended by a sandbox failure is neither reward 0 nor lost: it comes back."""
    rows = PromptStream(SAMPLES, 0)
    a, b = rows.row(1)["id"], rows.row(4)["id"]  # the samples of prompt draws 1 and 4
    fail = {a: 1, b: 2}
    lock = threading.Lock()
    loop, eng, seen = _loop(tiny, lambda: FlakyEnv(fail, lock), steps=4, per_step=2, s=0, frac=1.0)
    asyncio.run(_run(loop, eng))
    trained = [u for m in seen for u in m["uids"]]
    assert fail == {a: 0, b: 0}
    assert loop.counters["infra_failed"] == 3 and loop.counters["infra_failed_groups"] == 3
    # the re-queued prompts were trained later, each exactly once
    assert sorted(trained) == list(range(8)) and len(trained) == len(set(trained))
    assert loop.counters["episodes_trained"] == 8 and loop.counters["episodes"] == 8 + 3
    assert seen[-1]["rollout/infra_failed"] == 3.0
    assert sum(m["rollout/infra_failed_step"] for m in seen) == 3.0
    # nothing infra-failed reached a batch: every trained episode was scored by the env
    assert not any(k.startswith("rollout/finish_infra_error") for m in seen for k in m)


def test_too_many_infra_failures_stop_the_run(tiny):
    fail = {s["id"]: 10 ** 6 for s in SAMPLES}  # the sandbox never works
    loop, eng, seen = _loop(tiny, lambda: FlakyEnv(fail, threading.Lock()), steps=3, per_step=2, frac=0.5)
    with pytest.raises(TrainingError, match=r"2 of the last 2 finished episodes \(a step's worth\) ended by "
                                            r"an infrastructure failure, more than "
                                            r"train.max_infra_failure_fraction=0.5; last: infra_error: "
                                            r"sandbox for s\d+"):
        asyncio.run(_run(loop, eng))
    assert seen == []


def test_zero_fraction_stops_at_the_first_infra_failure(tiny):
    fail = {PromptStream(SAMPLES, 0).row(0)["id"]: 1}
    loop, eng, _ = _loop(tiny, lambda: FlakyEnv(fail, threading.Lock()), steps=3, frac=0.0, s=0)
    with pytest.raises(TrainingError, match=r"^1 of the last 2 finished episodes"):
        asyncio.run(_run(loop, eng))


def test_counters_continue_from_a_checkpoint(tiny):
    """Issue 9 fault 10: every cumulative counter continues across a resume."""
    saved = {"episodes": 11, "episodes_trained": 8, "tokens_generated": 40, "tokens_trained": 30,
             "dropped_stale": 3, "infra_failed": 2, "infra_failed_groups": 1, "filtered_groups": 5}
    loop, eng, seen = _loop(tiny, EchoEnv, steps=6, per_step=2, s=0, counters=saved, start_step=4)
    asyncio.run(_run(loop, eng))
    c = loop.counters
    assert c["episodes_trained"] == 8 + 4 and c["dropped_stale"] == 3 and c["infra_failed"] == 2
    assert c["filtered_groups"] == 5 and seen[-1]["rollout/filtered_groups"] == 5.0  # no filter here
    assert c["episodes"] >= 11 + 4  # more may have finished than were trained, never fewer
    assert c["tokens_trained"] == 30 + sum(m["rollout/model_tokens"] * 2 for m in seen)
    assert seen[0]["rollout/dropped_stale"] == 3.0 and seen[0]["rollout/episodes_trained_total"] == 10.0
    assert loop.loop_state()["counters"] == c and set(c) == set(COUNTERS)
    with pytest.raises(ValueError, match="unknown key"):
        _loop(tiny, EchoEnv, counters={"bogus": 1})


def test_an_engine_that_never_gets_weights_fails_instead_of_spinning(tiny):
    """Rollouts that are always too stale (engine stuck at an old version) used to spin forever."""
    loop, eng, seen = _loop(tiny, EchoEnv, steps=6, per_step=2, s=1, start_step=4, engine_version=0)
    with pytest.raises(TrainingError, match=r"groups dropped as stale since step 4 without any step: "
                                            r"rollouts come from policy version 0 while the learner is at 4"):
        asyncio.run(_run(loop, eng))
    assert seen == [] and loop.counters["dropped_stale"] > 8


def test_bad_failure_fraction_is_rejected():
    with pytest.raises(ValueError, match=r"max_infra_failure_fraction=1.5"):
        LoopConfig(total_steps=1, prompts_per_step=1, n_samples_per_prompt=1, pad_token_id=0,
                   staleness=BoundedAdmission(0), max_infra_failure_fraction=1.5)
