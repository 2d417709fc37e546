"""Controlled staleness (``train.staleness: {mode: fixed, lag: k}``): exact lag k on every token, k = 0 is
synchronous training bit for bit, infrastructure failures refilled with the same lagged version,
kept versions survive a resume.

Real components: a tiny transformers model in the embedded engine, a pure-Python tool env (and
the real math sandbox end to end), the real :class:`AsyncTrainingLoop` and :class:`TorchLearner`.
"""

from __future__ import annotations

import asyncio
import copy
import json
import threading
import time

import pytest
import torch

import copc
from trainer.app.assemble import loop_config
from trainer.app.run import run_experiment
from trainer.config import ConfigError, load_config
from trainer.engines.base import SamplingParams
from trainer.engines.embedded import EmbeddedEngine
from trainer.learner.backends.torch import TorchLearner
from trainer.learner.settings import LearnerConfig, OptimizerSettings
from trainer.models.loading import load_model_and_tokenizer
from trainer.models.tiny import TinyModelConfig, save_tiny_checkpoint
from trainer.orchestration.lag import WeightHistory, generating_version
from trainer.orchestration.loop import AsyncTrainingLoop, FixedLag, LoopConfig, LoopState
from trainer.orchestration.prompts import PromptStream
from trainer.orchestration.rollouts import LocalRollouts, engine_handle
from trainer.rollout.agent_loop import AgentLoopConfig

from ..app.test_run_e2e import overrides
from .test_loop_failures import FlakyEnv
from .test_loop_learner import SAMPLES, EchoEnv, Recorder


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return str(save_tiny_checkpoint(tmp_path_factory.mktemp("tiny_lag"),
                                    TinyModelConfig(hidden_size=32, intermediate_size=64, num_layers=1)))


def _run_fixed(path, k, *, steps=6, per_step=2, make_env=EchoEnv, learner_delay=0.0, history=None,
               start_step=0, state=None, sync_check=None):
    actor, tok = load_model_and_tokenizer(path)
    learner = TorchLearner(actor, copc.get_preset("copc"),
                           LearnerConfig(
                               optim=OptimizerSettings(actor_lr=1e-2, critic_lr=1e-3), micro_batch_size=4))
    if state is not None:
        learner.load_state_dict(state)
    real_step = learner.step

    def slow_step(batch):
        time.sleep(learner_delay)
        return real_step(batch)

    learner.step = slow_step
    real_export = learner.export_policy_weights

    def slow_export():  # as a remote learner's: rollouts finish meanwhile
        time.sleep(0.05)
        return real_export()

    learner.export_policy_weights = slow_export
    hooks = Recorder()
    synced: list[int] = []

    class RecordingRollouts(LocalRollouts):
        async def sync(self, source, version):
            synced.append(version)
            await super().sync(source, version)

    async def main():
        eng = EmbeddedEngine(copy.deepcopy(actor), tok, version=start_step)
        sampling = SamplingParams(max_new_tokens=5, seed=0)
        agent = AgentLoopConfig(max_turns=1)
        rollouts = RecordingRollouts(engine_handle(eng), make_env, tok, sampling, agent, 4)
        loop = AsyncTrainingLoop(
            learner, rollouts, PromptStream(SAMPLES, 0),
            LoopConfig(total_steps=steps, prompts_per_step=per_step, n_samples_per_prompt=1,
                       pad_token_id=tok.pad_token_id, staleness=FixedLag(k), sync_check=sync_check),
            hooks, LoopState.resume({"step": start_step, "weight_history": history}))
        try:
            await asyncio.wait_for(loop.run(), 180)
        finally:
            await rollouts.close()
            await eng.close()
        return loop, eng

    loop, eng = asyncio.run(main())
    return loop, eng, hooks.seen, synced


@pytest.mark.parametrize("k", [0, 1, 3])
def test_fixed_lag_gives_staleness_exactly_k_on_every_token(tiny, k):
    # a slow learner: in bounded mode rollouts would run ahead by a machine-dependent amount
    loop, eng, seen, synced = _run_fixed(tiny, k, learner_delay=0.2)
    assert [m["step"] for m in seen] == [1, 2, 3, 4, 5, 6]
    for m in seen:
        n = m["step"] - 1  # the learner's policy version when it trained this batch
        assert m["staleness/per_token"], "every batch has model tokens"
        assert set(m["staleness/per_token"]) == {min(n, k)}, (n, k)
    uids = [u for m in seen for u in m["uids"]]
    assert len(uids) == len(set(uids)) == 12
    assert loop.counters["episodes"] == 12  # nothing generated beyond the batches
    for m in seen:
        assert m["uids"] == sorted(m["uids"])  # batches ordered by prompt draw, not completion
    # the engine was synced to each generating version once, in order, and to the newest at the end
    assert synced == [*range(1, 6 - k), 6]
    assert eng.version == 6 and loop.version == 6
    assert loop.state.history.versions() == list(range(6 - k, 7))


def test_fixed_lag_refills_infrastructure_failures_with_the_same_version(tiny):
    stream = PromptStream(SAMPLES, 0)  # the loop draws prompts in this order
    drawn = [stream.row(stream.next())["id"] for _ in range(5)]
    fail = {drawn[0]: 1, drawn[4]: 2}  # the 1st and 5th drawn prompts fail once / twice before they run
    loop, _eng, seen, _ = _run_fixed(tiny, 2, steps=4, make_env=lambda: FlakyEnv(fail, threading.Lock()))
    assert [m["step"] for m in seen] == [1, 2, 3, 4]
    for m in seen:
        assert len(m["uids"]) == 2
        assert set(m["staleness/per_token"]) == {min(m["step"] - 1, 2)}
    assert loop.counters["infra_failed"] == 3 and set(fail.values()) == {0}
    assert loop.counters["episodes"] == 8 + 3


def test_fixed_lag_resume_keeps_the_exact_lag(tiny):
    k = 2
    loop, _, _seen, _ = _run_fixed(tiny, k, steps=3)
    state = loop.loop_state()
    assert sorted(state["weight_history"]) == [1, 2, 3]
    # the kept versions are the weights the learner had at those versions: version 3 = now
    now = dict(loop.learner.export_policy_weights())
    assert all(torch.equal(now[n], state["weight_history"][3][n]) for n in now)
    learner_state = loop.learner.state_dict()
    _loop2, _, seen2, synced2 = _run_fixed(tiny, k, steps=5, start_step=3, state=learner_state,
                                          history=state["weight_history"])
    assert [m["step"] for m in seen2] == [4, 5]
    assert all(set(m["staleness/per_token"]) == {k} for m in seen2)
    assert synced2[0] == 1  # batch 3 is generated by version 1, restored from the checkpoint


def test_weight_history_keeps_copies_not_views():
    w = torch.zeros(3)
    h = WeightHistory(1)
    h.add(0, [("w", w)])
    w += 1  # the learner's parameter changes after the snapshot
    h.add(1, [("w", w)])
    h.add(2, [("w", w + 1)])
    assert h.versions() == [1, 2]
    assert dict(h.get(1).export_policy_weights())["w"].tolist() == [1.0, 1.0, 1.0]
    with pytest.raises(KeyError, match="policy version 0 is not kept"):
        h.get(0)
    assert generating_version(5, 3) == 2 and generating_version(1, 3) == 0
    with pytest.raises(ValueError, match="lag=-1"):
        generating_version(1, -1)


def test_config_validation_names_the_key():
    with pytest.raises(ConfigError, match=r"train\.staleness\.mode='exact'"):
        load_config(None, ["train.staleness.mode=exact"])
    with pytest.raises(ConfigError, match=r"train\.staleness\.lag=-1"):
        load_config(None, ["train.staleness={mode: fixed, lag: -1}"])
    # a preset that fixes its staleness wins in either mode (ppo is synchronous: lag 0)
    cfg = load_config(None, ["preset=ppo", "train.staleness.mode=fixed", "train.staleness.lag=2"])
    assert cfg.max_staleness == 0 and loop_config(cfg, pad_token_id=0).staleness == FixedLag(0)
    cfg = load_config(None, ["train.staleness={mode: fixed, lag: 5}"])
    assert cfg.max_staleness == 5
    with pytest.raises(ConfigError, match=r"train\.staleness\.lag=3: not a setting of train\.staleness\.mode="
                                          r"'bounded'"):
        load_config(None, ["train.staleness.lag=3"])  # silently ignored before


def _step_rows(path):
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    # wall-clock measurements differ between any two runs; the weight-sync attestation (sync/) runs in
    # bounded mode only (the learner holds the synced version there), it changes no training value
    timing = ("perf/", "time/", "sync/")
    return [{k: v for k, v in r.items() if not k.startswith(timing) and k not in ("time", "wall_s")}
            for r in rows if "actor/pg_loss" in r]


@pytest.mark.slow
def test_fixed_lag_zero_equals_synchronous_training_bit_for_bit(tmp_path):
    """Fixed lag 0 reproduces ``ppo_async`` with bound 0 (same seeds → identical
    metrics.jsonl apart from timings), through the whole ``copc train`` path and the real sandbox."""
    runs = {}
    for name, extra in (("bounded", {"train.staleness.max": "0"}),
                        ("fixed", {"train.staleness.mode": "fixed", "train.staleness.lag": "0"})):
        # one sequence per engine forward: batched generation varies µ's log-probs by ~1e-8
        # between any two runs (either mode), so bit-for-bit needs deterministic generation
        extra["rollout.engine_max_batch_size"] = "1"
        cfg = load_config(None, overrides(tmp_path / name, "ppo_async", steps=4, **extra))
        run_experiment(cfg)
        runs[name] = _step_rows(tmp_path / name / "metrics.jsonl")
    assert len(runs["bounded"]) == 4
    assert runs["bounded"] == runs["fixed"]


def test_copc_train_fixed_lag_resume_through_checkpoints(tmp_path):
    """``copc train`` path: the kept versions go into the checkpoint, so a resumed run (here: the
    same run continued to more steps) trains with exactly lag k again, with no step lost."""
    out = tmp_path / "lag"
    extra = {"train.staleness.mode": "fixed", "train.staleness.lag": "2", "logging.plots": "false"}
    run_experiment(load_config(None, overrides(out, "copc", steps=3, **extra)))
    summary = run_experiment(load_config(None, overrides(out, "copc", steps=5, **extra)), resume=True)
    assert summary["steps"] == 5 and summary["duplicate_trained_uids"] == 0
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    hist = {r["step"]: r["staleness/hist"] for r in rows if "actor/pg_loss" in r}
    # counts per staleness level: step n trains tokens exactly min(n - 1, 2) versions old
    assert sorted(hist) == [1, 2, 3, 4, 5]
    for step, h in hist.items():
        assert len(h) - 1 == min(step - 1, 2) and sum(h[:-1]) == 0
