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
from trainer.app.assemble import loop_config
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
from trainer.orchestration.state import Group
from trainer.outputs.plots import make_plots
from trainer.rollout.agent_loop import AgentLoopConfig
from trainer.rollout.trajectory import Trajectory

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
    loop_cfg = loop_config(cfg, pad_token_id=0)
    assert loop_cfg.group_filter == GroupFilter(64)
    assert loop_config(load_config(None, []), pad_token_id=0).group_filter is None
    with pytest.raises(ConfigError) as ei:
        load_config(None, ["train.filter_groups=true"])
    assert str(ei.value).startswith("rollout.n_samples_per_prompt=1: train.filter_groups")
    with pytest.raises(ConfigError) as ei:
        load_config(None, ["train.max_filtered_groups_per_batch=-2"])
    assert str(ei.value).startswith("train.max_filtered_groups_per_batch=-2: must be an int >= 0")
    with pytest.raises(ConfigError) as ei:
        load_config(None, ["train.filter_groups=3"])
    assert "train.filter_groups" in str(ei.value)


def _group(uid, batch):
    tr = Trajectory(prompt_ids=[1, 2], sample_id=f"s{uid}")
    tr.append_model_tokens([3, 4], [-1.0, -1.0], 0)
    return Group(uid, [tr], batch)


def test_fixed_lag_groups_in_flight_by_hand():
    """More groups in flight than the batch takes: what to start, and which kept groups the batch is."""
    lag = FixedLag(1, groups_in_flight=6)
    st = LoopState()
    st.pending = {20: 0, 21: 0, 22: 1}
    st.batch_ready = {0: 1}
    assert lag.missing(st, 0, 2) == (6 - 1 - 2, 2)  # keep 6 running or kept while short
    assert FixedLag(1).missing(st, 0, 2) == (2 - 1 - 2, 2)  # default: prompts_per_step
    st.batch_ready = {0: 2}
    assert lag.missing(st, 0, 2) == (0, 2)  # the batch has its groups: start none
    # the batch: its first 2 kept groups in draw order, once no group of it runs
    st.pending = {11: 0}
    st.ready = [_group(5, 0), _group(3, 0), _group(9, 0), _group(4, 1)]
    st.batch_ready, st.batch_version = {0: 3, 1: 1}, {0: 0}
    st.in_flight = {3, 4, 5, 9, 11}
    loop = SimpleNamespace(state=st, prompts=PromptStream(SAMPLES, 0), prompts_per_step=2)

    async def go():
        task = asyncio.create_task(lag.take_batch(loop))
        await asyncio.sleep(0.05)
        assert not task.done()  # group 11 of batch 0 still runs (it might come before 9 in draw order)
        async with st.cond:
            del st.pending[11]
            st.in_flight.discard(11)
            st.cond.notify_all()
        return await asyncio.wait_for(task, 5.0)

    batch = asyncio.run(go())
    assert [g.uid for g in batch] == [3, 5]
    assert [g.uid for g in st.ready] == [4]  # the next batch's group stays
    assert st.counters["surplus_groups"] == 1 and st.surplus_since_step == 1
    assert st.in_flight == {3, 4, 5} and loop.prompts.next() == 9  # surplus prompt re-queued, first


def test_fixed_lag_with_more_groups_in_flight_trains_full_batches(tiny):
    seen, trained, counters = _run_loop(tiny, FixedLag(1, groups_in_flight=6), steps=3)
    assert [len(b) for b in trained] == [8, 8, 8]
    assert all(int(sid[1:]) % 3 == 0 for b in trained for sid, _ in b)  # only groups with a spread
    assert [m["rollout/groups_trained"] for m in seen] == [2.0, 2.0, 2.0]
    assert counters["surplus_groups"] >= 1  # 6 groups at once for a batch of 2: some kept ones spare
    assert seen[-1]["rollout/surplus_groups"] == sum(m["rollout/surplus_groups_step"] for m in seen)
    assert counters["episodes"] >= 4 * (counters["filtered_groups"] + counters["surplus_groups"] + 2 * 3)


def test_groups_in_flight_config():
    base = ["train.filter_groups=true", "rollout.n_samples_per_prompt=4"]
    cfg = load_config(None, [*base, "train.staleness={mode: fixed, lag: 2, groups_in_flight: 8}"])
    assert loop_config(cfg, pad_token_id=0).staleness == FixedLag(2, 8)
    with pytest.raises(ConfigError) as ei:
        load_config(None, ["train.staleness={mode: fixed, lag: 2, groups_in_flight: 8}"])
    assert str(ei.value).startswith("train.staleness.groups_in_flight=8: needs train.filter_groups: true")
    with pytest.raises(ConfigError) as ei:
        load_config(None, [*base, "train.staleness={mode: bounded, max: 2, groups_in_flight: 8}"])
    assert str(ei.value).startswith("train.staleness.groups_in_flight=8: not a setting of")
    with pytest.raises(ConfigError) as ei:
        load_config(None, [*base, "train.staleness={mode: fixed, groups_in_flight: -1}"])
    assert str(ei.value).startswith("train.staleness.groups_in_flight=-1: must be an int >= 0")
    with pytest.raises(ConfigError) as ei:  # fewer than the batch's groups would change nothing
        load_config(None, [*base, "train.prompts_per_step=4",
                           "train.staleness={mode: fixed, groups_in_flight: 2}"])
    assert str(ei.value).startswith(
        "train.staleness.groups_in_flight=2: must be 0 or >= train.prompts_per_step=4")
    with pytest.raises(ConfigError) as ei:  # nothing dropped: every extra group would be surplus
        load_config(None, [*base, "train.max_filtered_groups_per_batch=0",
                           "train.staleness={mode: fixed, groups_in_flight: 16}"])
    assert "train.max_filtered_groups_per_batch=0 never drops a group" in str(ei.value)
