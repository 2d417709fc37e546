"""Weight-sync attestation (``train.sync_check_tolerance``) with a real embedded engine and a real
torch learner on a tiny transformers model: an honest sync is attested for every synced version,
in bounded and fixed-lag mode, with the engine's and the learner's probe log-probs equal and no
step waiting for it; a sync that keeps the old weights, or the old version, stops the run with
one line naming the version."""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import gc

import pytest
import torch

import copc
from trainer.config import ConfigError, load_config
from trainer.engines.base import SamplingParams
from trainer.engines.embedded import EmbeddedEngine
from trainer.errors import TrainingError
from trainer.learner.backends.torch import TorchLearner
from trainer.learner.settings import LearnerConfig, OptimizerSettings
from trainer.models.loading import load_model_and_tokenizer
from trainer.models.tiny import TinyModelConfig, save_tiny_checkpoint
from trainer.orchestration.attestation import PROBE_PROMPTS, SyncAttestor, SyncCheck
from trainer.orchestration.loop import AsyncTrainingLoop, BoundedAdmission, FixedLag, LoopConfig
from trainer.orchestration.prompts import PromptStream
from trainer.orchestration.rollouts import LocalRollouts, engine_handle
from trainer.rollout.agent_loop import AgentLoopConfig
from trainer.rollout.batch import to_batch
from trainer.rollout.trajectory import Trajectory

from .test_loop_learner import SAMPLES, EchoEnv, Recorder


class ParityEnv(EchoEnv):
    """Reward 1 when the response's first character has an even code: about half the episodes,
    so the advantages are not all 0 and the actor moves every step."""

    def score(self, sample, response, answer, tool_calls):
        return float(bool(response) and ord(response[0]) % 2 == 0), {}


@pytest.fixture(scope="module")
def tiny_small(tmp_path_factory):
    return str(save_tiny_checkpoint(tmp_path_factory.mktemp("tiny_sync"),
                                    TinyModelConfig(hidden_size=32, intermediate_size=64, num_layers=1)))


def _run(path, *, sync: str = "honest", staleness=None, tolerance: float = 1e-4, steps: int = 3,
         engine_offset: float = 0.0, hooks=None):
    """Train ``steps`` steps; ``engine_offset``: added to one engine weight before the run (an engine
    serving other weights than the learner's from the start)."""
    actor, tok = load_model_and_tokenizer(path)
    engine_model = copy.deepcopy(actor)
    with torch.no_grad():
        next(engine_model.parameters()).add_(engine_offset)
    initial = {k: v.clone() for k, v in actor.state_dict().items()}
    learner = TorchLearner(actor, copc.get_preset("copc"), LearnerConfig(
        optim=OptimizerSettings(actor_lr=1e-2, critic_lr=1e-2), micro_batch_size=4))
    hooks = hooks if hooks is not None else Recorder()
    checked = {}

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
                       sync_check=SyncCheck(tolerance, 1.0)), hooks)
        try:
            await loop.run()
        finally:
            checked.update(loop.attestor.checked)
            await rollouts.close()
            await eng.close()

    asyncio.run(main())
    return hooks.seen, checked


def test_an_honest_sync_is_attested_for_every_version_and_no_step_waits(tiny_small):
    seen, checked = _run(tiny_small)
    assert [m["step"] for m in seen] == [1, 2, 3]
    assert sorted(checked) == [1, 2, 3], checked  # every sync, the final one included
    assert all(0.0 <= d <= 1e-5 for d in checked.values()), checked
    reported = {int(m["sync/probe_version"]): m["sync/probe_max_abs_logp_diff"] for m in seen
                if "sync/probe_version" in m}  # a check finished before a later step is logged with it
    assert all(checked[v] == d for v, d in reported.items()) and 3 not in reported
    assert all(m["actor/grad_norm"] > 0 for m in seen)  # the policy moved: the check compared new weights
    assert [m["perf/sync_check_wait_s"] for m in seen] == [0.0, 0.0, 0.0]  # the engine's side runs beside
    assert all(m["perf/sync_check_ref_s"] > 0.0 for m in seen)  # the learner's side: one small forward


def test_a_sync_that_keeps_the_old_weights_stops_the_run_naming_the_version(tiny_small):
    with pytest.raises(TrainingError) as ei:
        _run(tiny_small, sync="stale_weights")  # the first failing check is reported
    msg = str(ei.value)
    assert msg.startswith("weight sync check failed: after the sync the engine log-probs differ by ")
    assert "at policy version 1 (train.sync_check_tolerance=0.0001)" in msg and "\n" not in msg


def test_an_engine_on_other_weights_from_the_start_stops_the_run_before_any_step(tiny_small):
    """The start-up check: an engine whose weights differ from the learner's before any sync (here
    one weight tensor offset by 0.05) stops the run in one line naming version 0, before a single
    step is trained on its episodes; without the start-up check this run trained a step first (the
    first sync then loads the learner's weights, and the sync check passes)."""
    hooks = Recorder()
    with pytest.raises(TrainingError) as ei:
        _run(tiny_small, engine_offset=0.05, hooks=hooks)
    msg = str(ei.value)
    assert msg.startswith("weight sync check failed at start-up: before any sync the engine's log-probs "
                          "differ by ") and "\n" not in msg
    assert "from the learner's at policy version 0 (train.sync_check_tolerance=0.0001)" in msg
    assert hooks.seen == []
    seen, checked = _run(tiny_small, engine_offset=0.0, steps=1)  # the same run, same weights: passes
    assert [m["step"] for m in seen] == [1] and sorted(checked) == [1]


def test_the_last_version_is_checked_too(tiny_small):
    with pytest.raises(TrainingError, match="at policy version 1 "):
        _run(tiny_small, sync="stale_weights", steps=1)


def test_a_sync_that_never_happens_is_another_version(tiny_small):
    with pytest.raises(TrainingError, match="engine reported another policy version than policy version 1"):
        _run(tiny_small, sync="no_sync")


def test_fixed_lag_is_attested_against_the_kept_versions_reference(tiny_small):
    """The producer syncs the kept copy of version n − k while the learner is at n: each sync is
    compared with the reference the learner took when it held that version."""
    seen, checked = _run(tiny_small, staleness=FixedLag(1), steps=3)
    assert [m["step"] for m in seen] == [1, 2, 3]
    # batch 0 and 1 come from version 0 (the engine's own weights, no sync), batch 2 from a sync
    # to version 1; the run ends with the engine synced to the final version 3
    assert sorted(checked) == [1, 3] and all(d <= 1e-5 for d in checked.values()), checked
    with pytest.raises(TrainingError, match="at policy version 1 "):
        _run(tiny_small, sync="stale_weights", staleness=FixedLag(1), steps=3)


def test_the_reference_is_the_learners_own_score_of_the_sampled_token(tiny_small):
    """``next_token_logprobs`` (the reference) equals what ``recompute`` (the learner's training
    path) gives the token after each probe prompt, at temperature 0.7."""
    actor, tok = load_model_and_tokenizer(tiny_small)
    cfg = LearnerConfig(optim=OptimizerSettings(actor_lr=1e-2, critic_lr=1e-2), temperature=0.7)
    learner = TorchLearner(actor, copc.get_preset("copc"), cfg)
    ref = learner.next_token_logprobs(torch.tensor(PROBE_PROMPTS), 0.7)
    assert ref.shape == (len(PROBE_PROMPTS), actor.config.vocab_size) and ref.dtype == torch.float32
    assert torch.allclose(ref.exp().sum(-1), torch.ones(len(PROBE_PROMPTS)), atol=1e-5)
    trajs = []
    for i, prompt in enumerate(PROBE_PROMPTS):
        tr = Trajectory(prompt_ids=list(prompt))
        tr.append_model_tokens([40 + i], [0.0], [0])
        trajs.append(tr)
    batch = to_batch(trajs, tok.pad_token_id)
    logp = learner.recompute(batch)[0]
    got = logp[batch.loss_mask.bool()]
    want = torch.stack([ref[i, 40 + i] for i in range(len(PROBE_PROMPTS))])
    assert torch.allclose(got, want, atol=1e-5), (got, want)


def test_attestation_is_off_when_a_side_cannot_take_part():
    class NoProbe:
        pass

    class Scorer:
        def next_token_logprobs(self, ids, t):
            return torch.zeros(len(ids), 64)

    assert not SyncAttestor(SyncCheck(1e-3), NoProbe(), Scorer(), 3).enabled
    assert not SyncAttestor(SyncCheck(1e-3), LocalRollouts.__new__(LocalRollouts), NoProbe(), 3).enabled
    assert not SyncAttestor(None, LocalRollouts.__new__(LocalRollouts), Scorer(), 3).enabled
    on = SyncAttestor(SyncCheck(1e-3), LocalRollouts.__new__(LocalRollouts), Scorer(), 3)
    assert on.enabled

    async def refs():  # references of the last ``keep`` versions are kept
        for v in range(6):
            assert await on.reference(v) >= 0.0
        return sorted(on._refs)

    assert asyncio.run(refs()) == [3, 4, 5]

    class Broken:
        def next_token_logprobs(self, ids, t):
            raise RuntimeError("no device")

    off = SyncAttestor(SyncCheck(1e-3), LocalRollouts.__new__(LocalRollouts), Broken(), 3)
    assert asyncio.run(off.reference(0)) == 0.0 and not off.enabled  # logged, never the run's failure


def test_the_tolerance_is_validated_in_one_line():
    with pytest.raises(ConfigError, match=r"train\.sync_check_tolerance=0.*must be a number > 0"):
        load_config("configs/math_tool/cpu_tiny.yaml", ["train.sync_check_tolerance=0"])
    assert load_config("configs/math_tool/cpu_tiny.yaml", ["train.sync_check_tolerance=null"]
                       ).train.sync_check_tolerance is None
    with pytest.raises(ValueError, match=r"train\.sync_check_tolerance=-1"):
        SyncCheck(-1)


def test_a_check_the_run_never_collects_is_dropped_quietly(tiny_small):
    """A run stopped mid-check (SIGTERM, the engine closed under the probe) leaves no 'Task
    exception was never retrieved' behind; a check that is collected still reports its failure."""
    actor, tok = load_model_and_tokenizer(tiny_small)
    learner = TorchLearner(actor, copc.get_preset("copc"), LearnerConfig(
        optim=OptimizerSettings(actor_lr=1e-2, critic_lr=1e-2)))
    unretrieved = []

    async def main(collect: bool):
        asyncio.get_running_loop().set_exception_handler(lambda loop, ctx: unretrieved.append(ctx))
        eng = EmbeddedEngine(copy.deepcopy(actor), tok)
        rollouts = LocalRollouts(engine_handle(eng), ParityEnv, tok, SamplingParams(max_new_tokens=1),
                                 AgentLoopConfig(max_turns=1), 1)
        att = SyncAttestor(SyncCheck(1e-4), rollouts, learner, 3)
        await att.reference(1)
        await att.synced(1)  # the check starts; the engine closes before it answers
        await eng.close()
        await asyncio.sleep(0.05)
        assert all(t.done() for t in att._pending)
        if collect:
            return await att.collect()  # the probe's own failure: logged, no verdict
        att._pending = []  # the run stopped without collecting

    assert asyncio.run(main(collect=True)) == {}
    asyncio.run(main(collect=False))
    gc.collect()
    assert unretrieved == [], unretrieved
