"""Dynamic sampling (``train.filter_groups``): groups whose episodes all got one reward are dropped.

Real components: a tiny transformers model in the embedded engine, a pure-Python env, the real
:class:`AsyncTrainingLoop` and :class:`TorchLearner`, both staleness strategies.
"""

from __future__ import annotations

import asyncio
import copy
import threading
from types import SimpleNamespace

import pytest

import copc
from trainer.config import ConfigError, load_config
from trainer.engines.base import SamplingParams
from trainer.engines.embedded import EmbeddedEngine
from trainer.learner.backends.torch import TorchLearner
from trainer.learner.settings import LearnerConfig, OptimizerSettings
from trainer.models.loading import load_model_and_tokenizer
from trainer.models.tiny import TinyModelConfig, save_tiny_checkpoint
from trainer.orchestration.group_filter import GroupFilter, reward_spread
from trainer.orchestration.loop import AsyncTrainingLoop, BoundedAdmission, FixedLag, LoopConfig, LoopState
from trainer.orchestration.prompts import PromptStream
from trainer.orchestration.rollouts import LocalRollouts, engine_handle
from trainer.outputs.plots import make_plots
from trainer.rollout.agent_loop import AgentLoopConfig

from .test_loop_learner import SAMPLES, EchoEnv, Recorder


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return str(save_tiny_checkpoint(tmp_path_factory.mktemp("tiny_filter"),
                                    TinyModelConfig(hidden_size=32, intermediate_size=64, num_layers=1)))


class CountingEnv(EchoEnv):
    """Reward by sample and episode, not by the text: the ``k``-th episode of sample ``s<i>`` gets
    ``k % 2`` when ``i % 3 == 0`` (a group of 4 has rewards 0, 1, 0, 1) and 0 otherwise (no spread).
    ``informative=False``: every episode gets 0. The count is shared by every env instance."""

    def __init__(self, seen: dict[str, int], lock: threading.Lock, informative: bool = True) -> None:
        super().__init__()
        self.seen, self.lock, self.informative = seen, lock, informative

    def score(self, sample, response, answer, tool_calls):
        sid = sample["id"]
        with self.lock:
            k = self.seen.get(sid, 0)
            self.seen[sid] = k + 1
        return float(self.informative and int(sid[1:]) % 3 == 0 and k % 2 == 1), {}


def _run_loop(path, staleness, *, steps, informative=True, cap=64):
    actor, tok = load_model_and_tokenizer(path)
    learner = TorchLearner(actor, copc.get_preset("copc"), LearnerConfig(
        optim=OptimizerSettings(actor_lr=1e-3, critic_lr=1e-3), micro_batch_size=4))
    eng = EmbeddedEngine(copy.deepcopy(actor), tok, version=0)
    seen, lock, trained = {}, threading.Lock(), []

    class Keep(Recorder):
        def on_trained(self, step, trajs, learner):
            trained.append([(t.sample_id, t.reward) for t in trajs])

    hooks = Keep()
    rollouts = LocalRollouts(engine_handle(eng), lambda: CountingEnv(seen, lock, informative), tok,
                             SamplingParams(max_new_tokens=3, seed=0), AgentLoopConfig(max_turns=1), 8)
    loop = AsyncTrainingLoop(learner, rollouts, PromptStream(SAMPLES, 0), LoopConfig(
        total_steps=steps, prompts_per_step=2, n_samples_per_prompt=4, pad_token_id=tok.pad_token_id,
        staleness=staleness, checkpoint_every=100, group_filter=GroupFilter(cap)), hooks, LoopState())

    async def go():
        try:
            await asyncio.wait_for(loop.run(), 120.0)
        finally:
            await rollouts.close()
            await eng.close()

    asyncio.run(go())
    return hooks.seen, trained, loop.state.counters


@pytest.mark.parametrize("staleness", [BoundedAdmission(1), FixedLag(1)], ids=["bounded", "fixed_lag"])
def test_only_groups_with_a_reward_spread_are_trained(tiny, staleness):
    seen, trained, counters = _run_loop(tiny, staleness, steps=3)
    assert len(trained) == 3
    for batch in trained:
        assert len(batch) == 8  # 2 groups of 4, refilled after every drop
        ids = [sid for sid, _ in batch]
        assert all(int(sid[1:]) % 3 == 0 for sid in ids)  # only the samples with a spread
        for g in range(2):
            assert sorted(r for _, r in batch[4 * g:4 * g + 4]) == [0.0, 0.0, 1.0, 1.0]
    # every dropped group is counted: per step, and cumulatively (the same total)
    assert counters["filtered_groups"] >= 1
    total = seen[-1]["rollout/filtered_groups"]  # a group may still be dropped after the last step
    assert total == sum(m["rollout/filtered_groups_step"] for m in seen) <= counters["filtered_groups"]
    assert counters["episodes"] >= 4 * (counters["filtered_groups"] + 2 * 3)
    assert [m["rollout/groups_trained"] for m in seen] == [2.0, 2.0, 2.0]


def test_the_end_of_run_plot(tmp_path):
    metrics = [{"step": s, "rollout/filtered_groups_step": float(10 - s), "rollout/groups_trained": 4.0}
               for s in range(1, 9)]
    (path,) = make_plots(metrics, tmp_path)
    assert path.name == "filtered_groups.png" and path.stat().st_size > 5000
    assert make_plots([{"step": 1, "rollout/groups_trained": 4.0}], tmp_path / "b")[0].name == \
        "filtered_groups.png"


def test_a_policy_without_reward_never_stalls_the_run(tiny):
    """All rewards 0: each batch drops exactly ``cap`` groups, then trains on what comes."""
    seen, trained, counters = _run_loop(tiny, FixedLag(1), steps=3, informative=False, cap=3)
    assert len(trained) == 3 and all(len(b) == 8 for b in trained)
    assert counters["filtered_groups"] == 3 * 3
    assert seen[-1]["rollout/filtered_groups"] == 9.0


def test_group_filter_rule():
    ep = [SimpleNamespace(reward=r) for r in (0.0, 0.25, 0.0)]
    assert reward_spread(ep) == 0.25 and reward_spread([]) == 0.0
    flt = GroupFilter(2)
    assert not flt.drops(ep, 0)                     # a spread: kept
    assert flt.drops(ep[:1] + ep[2:], 0)            # all 0: dropped
    assert flt.drops([SimpleNamespace(reward=1.0)] * 3, 1)   # all 1: dropped too
    assert not flt.drops(ep[:1] + ep[2:], 2)        # the cap reached: kept
    assert not GroupFilter(0).drops(ep[:1], 0)      # cap 0: never drops
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match=r"GroupFilter\.max_per_batch="):
            GroupFilter(bad)


def test_config_keys():
    cfg = load_config(None, ["train.filter_groups=true", "rollout.n_samples_per_prompt=4"])
    loop_cfg = LoopConfig.from_config(cfg, pad_token_id=0)
    assert loop_cfg.group_filter == GroupFilter(64)
    assert LoopConfig.from_config(load_config(None, []), pad_token_id=0).group_filter is None
    with pytest.raises(ConfigError) as ei:
        load_config(None, ["train.filter_groups=true"])
    assert str(ei.value).startswith("rollout.n_samples_per_prompt=1: train.filter_groups")
    with pytest.raises(ConfigError) as ei:
        load_config(None, ["train.max_filtered_groups_per_batch=-2"])
    assert str(ei.value).startswith("train.max_filtered_groups_per_batch=-2: must be an int >= 0")
    with pytest.raises(ConfigError) as ei:
        load_config(None, ["train.filter_groups=3"])
    assert "train.filter_groups" in str(ei.value)
