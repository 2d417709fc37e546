"""Async loop: staleness bound under slow learner / slow rollouts; learner exactness."""

from __future__ import annotations

import asyncio
import copy
import time

import pytest
import torch

import copc
from environments.base import RegexTool, ToolEnv
from trainer.app.assemble import loop_config
from trainer.config import ConfigError, load_config
from trainer.engines.base import SamplingParams
from trainer.engines.embedded import EmbeddedEngine
from trainer.learner.backends.torch import TorchLearner
from trainer.learner.settings import LearnerConfig, OptimizerSettings
from trainer.models.loading import load_model_and_tokenizer
from trainer.models.tiny import TinyModelConfig, save_tiny_checkpoint
from trainer.orchestration.loop import AsyncTrainingLoop, BoundedAdmission, LoopConfig, LoopState
from trainer.orchestration.prompts import PromptStream
from trainer.orchestration.rollouts import LocalRollouts, LoopHooks, engine_handle
from trainer.orchestration.state import Group
from trainer.rollout.agent_loop import AgentLoopConfig
from trainer.rollout.batch import to_batch
from trainer.rollout.trajectory import Trajectory


class EchoEnv(ToolEnv):
    """A real (pure-Python) one-turn env: reward 1 if the action contains the letter 'a'.

    ``step_delay_s`` makes rollouts slow on purpose.
    """

    def __init__(self, step_delay_s: float = 0.0) -> None:
        super().__init__(tools=[], invalid_action_reply=None)
        self.step_delay_s = step_delay_s

    def build_prompt(self, sample):
        return f"Say something {sample['id']}:"

    def extract_answer(self, action):
        return action

    def score(self, sample, response, answer, tool_calls):
        return float("a" in response), {}

    def step(self, action):
        time.sleep(self.step_delay_s)
        return super().step(action)


assert not isinstance(RegexTool, type(None))


@pytest.fixture(scope="module")
def tiny_small(tmp_path_factory):
    return str(save_tiny_checkpoint(tmp_path_factory.mktemp("tiny32"),
                                    TinyModelConfig(hidden_size=32, intermediate_size=64, num_layers=1)))


SAMPLES = [{"id": f"s{i}"} for i in range(100)]


class Recorder(LoopHooks):
    """Hooks that record every step's metrics (``seen``) and, given a list, the checkpoints."""

    def __init__(self, checkpoints: list | None = None) -> None:
        self.seen: list[dict] = []
        self.checkpoints = checkpoints

    def on_step(self, step, metrics, uids):
        self.seen.append({"step": step, "uids": uids, **metrics})

    def save_checkpoint(self, step, loop_state):
        if self.checkpoints is None:
            return False
        self.checkpoints.append((step, loop_state))
        return True


def run_loop(path, preset, s, *, learner_delay=0.0, env_delay=0.0, steps=6, per_step=2, n=1, trim=False):
    actor, tok = load_model_and_tokenizer(path)
    engine_model = copy.deepcopy(actor)
    algo = copc.get_preset(preset)
    learner = TorchLearner(actor, algo, LearnerConfig(
        optim=OptimizerSettings(actor_lr=1e-3, critic_lr=1e-3), micro_batch_size=4))
    real_step = learner.step

    def slow_step(batch):
        time.sleep(learner_delay)
        return real_step(batch)

    learner.step = slow_step
    hooks = Recorder()

    async def main():
        eng = EmbeddedEngine(engine_model, tok)
        rollouts = LocalRollouts(engine_handle(eng), lambda: EchoEnv(env_delay), tok,
                                 SamplingParams(max_new_tokens=6, seed=0), AgentLoopConfig(max_turns=1), 8)
        loop = AsyncTrainingLoop(
            learner, rollouts, PromptStream(SAMPLES, 0),
            LoopConfig(total_steps=steps, prompts_per_step=per_step, n_samples_per_prompt=n,
                       pad_token_id=tok.pad_token_id, staleness=BoundedAdmission(s), malloc_trim=trim), hooks)
        await loop.run()
        await rollouts.close()
        await eng.close()
        return loop

    loop = asyncio.run(main())
    return loop, hooks.seen


@pytest.mark.parametrize("s", [0, 1, 8])
@pytest.mark.parametrize("who_is_slow", ["learner", "rollouts"])
def test_staleness_never_exceeds_bound(tiny_small, s, who_is_slow):
    kw = {"learner_delay": 0.3} if who_is_slow == "learner" else {"env_delay": 0.05}
    loop, seen = run_loop(tiny_small, "copc", s, **kw)
    assert [m["step"] for m in seen] == list(range(1, 7))
    maxes = [m["staleness/max"] for m in seen]
    assert max(maxes) <= s
    for m in seen:  # per token, from the trained batch itself
        assert all(0 <= h <= s for h in m["staleness/per_token"])
    if s == 0:
        assert max(maxes) == 0
    elif who_is_slow == "learner":
        assert max(maxes) >= 1, "with a slow learner, async rollouts must actually run ahead"
    uids = [u for m in seen for u in m["uids"]]
    assert len(uids) == len(set(uids)) == 12
    assert loop.version == 6


@pytest.mark.parametrize("trim", [True, False])
def test_malloc_trim_runs_after_every_learner_step_when_on(tiny_small, trim):
    _, seen = run_loop(tiny_small, "copc", 1, steps=2, trim=trim)
    assert [m["step"] for m in seen] == [1, 2]
    if trim:
        assert all(0.0 <= m["perf/malloc_trim_s"] < 60.0 for m in seen)
    else:
        assert not any("perf/malloc_trim_s" in m for m in seen)


def test_malloc_trim_is_on_by_default_and_reaches_the_loop():
    assert loop_config(load_config(None, []), pad_token_id=0).malloc_trim is True
    off = load_config(None, ["learner.malloc_trim=false"])
    assert loop_config(off, pad_token_id=0).malloc_trim is False
    with pytest.raises(ConfigError, match=r"^learner\.malloc_trim"):
        load_config(None, ["learner.malloc_trim=sometimes"])


def test_stale_groups_are_dropped_counted_and_requeued(tiny_small):
    actor, tok = load_model_and_tokenizer(tiny_small)
    learner = TorchLearner(actor, copc.get_preset("copc"), LearnerConfig())
    learner.steps_done = 5  # as if resumed at step 5
    prompts = PromptStream(SAMPLES, 0)
    rollouts = LocalRollouts(engine_handle(EmbeddedEngine(actor, tok)), EchoEnv, tok, SamplingParams(),
                             AgentLoopConfig(), 1)
    loop = AsyncTrainingLoop(learner, rollouts, prompts,
                             LoopConfig(total_steps=1, prompts_per_step=1, n_samples_per_prompt=1,
                                        pad_token_id=tok.pad_token_id, staleness=BoundedAdmission(1)),
                             state=LoopState(step=5))

    def group(uid, version):
        tr = Trajectory(prompt_ids=[1])
        tr.append_model_tokens([2, 3], [-0.1, -0.2], [version, version + 1])
        return Group(uid, [tr])

    loop.state.in_flight = {10, 11}
    loop.state.ready = [group(10, 3), group(11, 4)]  # oldest tokens 2 and 1 versions behind version 5

    async def take():
        return await loop.take_batch()

    batch = asyncio.run(take())
    assert [g.uid for g in batch] == [11]
    assert loop.state.dropped_stale == 1 and list(prompts.requeued) == [10] and 10 not in loop.state.in_flight
    assert prompts.next() == 10  # the dropped prompt is generated again, not lost


def test_prompt_stream_resume_roundtrip():
    a = PromptStream(SAMPLES[:7], seed=3)
    drawn = [a.next() for _ in range(10)]
    assert drawn == list(range(10))
    assert sorted(a.row(u)["id"] for u in range(7)) == sorted(s["id"] for s in SAMPLES[:7])
    state = a.state_dict(in_flight=[8, 9])
    b = PromptStream(SAMPLES[:7], seed=3)
    b.load_state_dict(state)
    assert [b.next() for _ in range(4)] == [8, 9, 10, 11]
    assert [b.row(u) for u in range(14)] == [a.row(u) for u in range(14)]


def _batch(tok, n=6):
    g = torch.Generator().manual_seed(0)
    trs = []
    for i in range(n):
        tr = Trajectory(prompt_ids=tok.encode(f"p{i}", add_special_tokens=False), sample_id=i,
                        group_id=i // 2)
        ids = torch.randint(0, 255, (5 + i,), generator=g).tolist()
        tr.append_model_tokens(ids[:3], [-5.0] * 3, 0)
        tr.append_observation_tokens(ids[3:4])
        tr.append_model_tokens(ids[4:], [-5.5] * len(ids[4:]), 0)
        tr.reward = float(i % 2)
        trs.append(tr)
    return to_batch(trs, tok.pad_token_id)


@pytest.mark.parametrize("preset", ["copc", "dapo", "areal"])
def test_micro_batch_split_does_not_change_the_update(tiny_small, preset):
    """Gradient accumulation over micro-batches equals one full-batch step."""
    _, tok = load_model_and_tokenizer(tiny_small)
    batch = _batch(tok)
    params = []
    for mbs in (1, 4, 6):
        torch.manual_seed(0)
        actor, _ = load_model_and_tokenizer(tiny_small)
        learner = TorchLearner(actor, copc.get_preset(preset), LearnerConfig(
            optim=OptimizerSettings(actor_lr=1e-2, critic_lr=1e-2, grad_clip=0.0), micro_batch_size=mbs))
        metrics = learner.step(batch, version=0)
        assert all(torch.isfinite(torch.tensor(v)) for v in metrics.values() if isinstance(v, float))
        params.append(torch.cat([p.detach().flatten() for p in actor.parameters()]))
    assert (params[0] - params[1]).abs().max() < 1e-5 and (params[0] - params[2]).abs().max() < 1e-5
    assert (params[0] - torch.cat([p.detach().flatten() for p in
                                   load_model_and_tokenizer(tiny_small)[0].parameters()])).abs().max() > 1e-4


def test_critic_warmup_freezes_actor(tiny_small):
    actor, tok = load_model_and_tokenizer(tiny_small)
    before = copy.deepcopy(actor.state_dict())
    learner = TorchLearner(actor, copc.get_preset("copc"), LearnerConfig(
        optim=OptimizerSettings(actor_lr=1e-2, critic_lr=1e-2), critic_warmup_steps=1))
    m = learner.step(_batch(tok), version=0)
    assert m["actor/updated"] == 0.0 and "critic/value_loss" in m
    assert all(torch.equal(before[k], v) for k, v in actor.state_dict().items())
    m = learner.step(_batch(tok), version=1)
    assert m["actor/updated"] == 1.0
    assert any(not torch.equal(before[k], v) for k, v in actor.state_dict().items())


def test_critic_free_presets_are_not_held_back_by_critic_warmup(tiny_small):
    actor, tok = load_model_and_tokenizer(tiny_small)
    learner = TorchLearner(actor, copc.get_preset("dapo"),
                           LearnerConfig(optim=OptimizerSettings(actor_lr=1e-2), critic_warmup_steps=2))
    assert learner.critic is None
    assert learner.step(_batch(tok), version=0)["actor/updated"] == 1.0


@pytest.mark.parametrize("preset", ["ppo_async", "vtrace", "brace"])
def test_actor_total_loss_is_the_mini_batch_loss_whatever_the_micro_batches(tiny_small, preset):
    """``actor/total_loss`` sums the micro-batch shares (global denominators), so it is the same for
    any ``micro_batch_size`` (it used to be a token-weighted mean of the shares: -0.08 / -0.13 / -0.25)."""
    out = []
    for mbs in (1, 3, 8):
        actor, tok = load_model_and_tokenizer(tiny_small)
        learner = TorchLearner(actor, copc.get_preset(preset), LearnerConfig(micro_batch_size=mbs))
        torch.manual_seed(0)
        trajs = []
        for i in range(6):
            tr = Trajectory(prompt_ids=[1, 2])
            n = 2 + i % 3
            tr.append_model_tokens(list(range(3, 3 + n)), [-1.0 - 0.1 * j for j in range(n)], [0] * n)
            tr.reward = float(i % 2)
            trajs.append(tr)
        out.append(learner.step(to_batch(trajs, tok.pad_token_id))["actor/total_loss"])
    assert out[0] == pytest.approx(out[1], abs=1e-6) and out[0] == pytest.approx(out[2], abs=1e-6)
    assert abs(out[0]) > 1e-4
