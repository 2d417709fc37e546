"""LoRA weight sync: the engine serves exactly the adapter version it reports, syncs move the adapter only,
fixed lag keeps k + 1 adapters (not k + 1 models) and generates every batch with the kept one, and
``copc train`` with ``learner.lora`` runs end to end through the real math sandbox.

COPC needs the behaviour policy to be exactly the recorded version: after every sync (with real
optimizer steps in between) the engine's per-token log-probs equal the learner's recomputation with
that adapter version (<= 1e-5). Real components: tiny transformers models with peft adapters, the
embedded engine built by its registered factory, the real loop, learner, sandbox and checkpoints.
"""

from __future__ import annotations

import asyncio
import copy
import json

import pytest
import torch

from trainer.app.run import run_experiment
from trainer.config import load_config
from trainer.config.specs import engine_spec, learner_spec
from trainer.engines import make_engine
from trainer.engines.base import SamplingParams
from trainer.learner.backends.torch import TorchLearner, response_logprobs
from trainer.models.loading import load_model_and_tokenizer
from trainer.models.lora import AdapterWeights, LoraSettings, inject_lora, load_adapter_tensors
from trainer.models.tiny import TinyModelConfig, save_tiny_checkpoint
from trainer.orchestration.loop import AsyncTrainingLoop, FixedLag, LoopConfig, LoopState
from trainer.orchestration.prompts import PromptStream
from trainer.orchestration.rollouts import LocalRollouts, push_weights
from trainer.outputs.checkpoint import CheckpointManager
from trainer.rollout.agent_loop import AgentLoopConfig
from trainer.rollout.batch import to_batch
from trainer.rollout.trajectory import Trajectory

from ..app.test_run_e2e import overrides
from ..orchestration.test_loop_learner import SAMPLES, EchoEnv, Recorder

pytestmark = pytest.mark.usefixtures("one_torch_thread")

LORA = LoraSettings(rank=4, alpha=8.0, dropout=0.1, target_modules=("q_proj", "v_proj", "up_proj"))
#: tiny model below: hidden 64, MLP 128, 4 heads of 16 (2 KV heads: v_proj 64 -> 32), 2 layers; float32
ADAPTER_BYTES = 2 * 4 * 4 * ((64 + 64) + (64 + 32) + (64 + 128))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return str(save_tiny_checkpoint(tmp_path_factory.mktemp("tiny_lora_sync"), TinyModelConfig(
        hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2)))


def _exp(tiny, *extra):
    return load_config(None, [f"model.path={tiny}", "learner.lora.rank=4", "learner.lora.alpha=8",
                              "learner.lora.dropout=0.1",
                              "learner.lora.target_modules=[q_proj,v_proj,up_proj]", *extra])


class Recording:
    """Wraps an engine handle's syncs to record what each one moved (and fail on a full-weight sync)."""

    def __init__(self, handle):
        self.handle, self.adapter_syncs = handle, []
        real = handle.sync_adapter

        async def sync_adapter(adapter, version):
            self.adapter_syncs.append((version, adapter.nbytes, sorted(adapter.tensors)))
            await real(adapter, version)

        async def full_sync(weights, version):
            raise AssertionError("a LoRA policy was synced with full weights")

        handle.sync_adapter, handle.sync = sync_adapter, full_sync


def _play(engine, tok, prompts, sampling):
    """One episode per prompt: a model turn, an observation, a second model turn (TITO)."""
    async def episode(i, p):
        tr = Trajectory(prompt_ids=p, sample_id=i, group_id=i)
        r1 = await engine.generate(p, sampling)
        tr.append_model_tokens(r1.token_ids, r1.logprobs, r1.versions)
        obs = tok.encode(f" <obs {i}> ", add_special_tokens=False)
        tr.append_observation_tokens(obs)
        r2 = await engine.generate(p + r1.token_ids + obs, sampling)
        tr.append_model_tokens(r2.token_ids, r2.logprobs, r2.versions)
        tr.reward = float(i % 2)
        return tr

    return asyncio.gather(*(episode(i, p) for i, p in enumerate(prompts)))


def _learner_logprobs(model, batch, temperature, top_p=1.0):
    model.eval()
    with torch.no_grad():
        return response_logprobs(model, batch, temperature, top_p=top_p)


def test_engine_logprobs_equal_the_learners_for_every_synced_adapter_version(tiny):
    exp = _exp(tiny, "train.actor_lr=0.05", "train.critic_lr=0.01", "train.micro_batch_size=4")
    learner = TorchLearner.from_spec(learner_spec(exp), tiny)
    _, tok = load_model_and_tokenizer(tiny)
    handle = make_engine("embedded", engine_spec(exp, tiny, tok, adapter=learner.export_adapter()))
    rec = Recording(handle)
    prompts = [tok.encode(s, add_special_tokens=False) for s in
               ["Problem: 2+2?", "x", "A longer prompt than the others, padded on the left.", "abc"]]
    sampling = SamplingParams(temperature=0.8, top_p=0.95, max_new_tokens=10, seed=5)
    full_bytes = sum(v.numel() * v.element_size() for v in learner.actor.state_dict().values())
    diffs, previous = [], None

    async def main():
        nonlocal previous
        for _ in range(4):
            version = learner.policy_version
            assert handle.engine.version == version  # the version the engine reports ...
            trajs = await _play(handle.engine, tok, prompts, sampling)
            assert {v for t in trajs for v, m in zip(t.versions, t.loss_mask, strict=True) if m} == {version}
            batch = to_batch(trajs, tok.pad_token_id)
            mask = batch.loss_mask.bool()
            # ... is the adapter version the learner recomputes with: per-token log-probs equal
            lp = _learner_logprobs(learner.actor, batch, sampling.temperature, sampling.top_p)
            diffs.append(float((lp - batch.logp_mu)[mask].abs().max()))
            if previous is not None:  # and it is not the previous version's adapter
                stale = _learner_logprobs(previous, batch, sampling.temperature, sampling.top_p)
                assert float((stale - batch.logp_mu)[mask].abs().max()) > 1e-3
            previous = copy.deepcopy(learner.actor)
            await asyncio.to_thread(learner.step, batch)  # a real optimizer step
            await push_weights(handle, learner, learner.policy_version)
        await handle.close()

    asyncio.run(main())
    assert max(diffs) <= 1e-5, diffs
    print("max |engine - learner| per version:", diffs)
    assert [v for v, _, _ in rec.adapter_syncs] == [1, 2, 3, 4]
    for _, nbytes, names in rec.adapter_syncs:  # adapter-only payloads
        assert nbytes == ADAPTER_BYTES and all(".lora_A." in n or ".lora_B." in n for n in names)
    assert full_bytes > ADAPTER_BYTES * 20
    print(f"LoRA sync payload: {ADAPTER_BYTES} B per sync vs {full_bytes} B of full weights")


def test_engine_refuses_mismatched_adapters_and_full_weights(tiny):
    exp = _exp(tiny)
    learner = TorchLearner.from_spec(learner_spec(exp), tiny)
    _, tok = load_model_and_tokenizer(tiny)
    handle = make_engine("embedded", engine_spec(exp, tiny, tok, adapter=learner.export_adapter()))
    other = AdapterWeights(LoraSettings(rank=2, alpha=8.0, dropout=0.1, target_modules=LORA.target_modules),
                           learner.export_adapter().tensors)
    missing = AdapterWeights(LORA, dict(list(learner.export_adapter().tensors.items())[1:]))

    async def main():
        from trainer.engines.base import EngineError
        try:
            with pytest.raises(EngineError, match=r"update_adapter: adapter settings .*'rank': 2.* differ"):
                await handle.engine.update_adapter(other, 1)
            with pytest.raises(EngineError, match=r"update_adapter: adapter tensors do not match .*missing"):
                await handle.engine.update_adapter(missing, 1)
            with pytest.raises(EngineError, match=r"serves a LoRA adapter; send adapter updates"):
                await handle.sync(learner.export_policy_weights(), 1)
            assert handle.engine.version == 0
        finally:
            await handle.close()

    asyncio.run(main())


def test_fixed_lag_keeps_adapters_and_generates_each_batch_with_the_kept_version(tiny):
    """Fixed lag k = 2: the history holds k + 1 adapters (bytes: adapters, not models); every trained
    batch's behaviour log-probs equal a recomputation with the kept adapter of its generating version."""
    k, steps = 2, 5
    exp = _exp(tiny, "train.actor_lr=0.05", "train.critic_lr=0.01", "train.micro_batch_size=4")
    learner = TorchLearner.from_spec(learner_spec(exp), tiny)
    base, tok = load_model_and_tokenizer(tiny)
    scratch = inject_lora(copy.deepcopy(base), LORA).eval()  # evaluates any kept adapter version
    handle = make_engine("embedded", engine_spec(exp, tiny, tok, adapter=learner.export_adapter()))
    rec = Recording(handle)
    loop_box, checks = [], []
    real_step = learner.step

    def checked_step(batch):
        versions = set(batch.versions[batch.loss_mask.bool()].tolist())
        assert versions == {max(learner.policy_version - k, 0)}
        kept = loop_box[0].state.history.get(versions.pop()).export_adapter()
        load_adapter_tensors(scratch, kept.tensors)
        lp = _learner_logprobs(scratch, batch, 1.0)
        checks.append(float((lp - batch.logp_mu)[batch.loss_mask.bool()].abs().max()))
        return real_step(batch)

    learner.step = checked_step
    hooks = Recorder(checkpoints=[])

    async def main():
        rollouts = LocalRollouts(handle, EchoEnv, tok, SamplingParams(max_new_tokens=6, seed=0),
                                 AgentLoopConfig(max_turns=1), 4)
        loop = AsyncTrainingLoop(learner, rollouts, PromptStream(SAMPLES, 0),
                                 LoopConfig(total_steps=steps, prompts_per_step=2, n_samples_per_prompt=1,
                                            pad_token_id=tok.pad_token_id, staleness=FixedLag(k),
                                            checkpoint_every=1), hooks)
        loop_box.append(loop)
        try:
            await asyncio.wait_for(loop.run(), 180)
        finally:
            await rollouts.close()
            await handle.close()
        return loop

    loop = asyncio.run(main())
    assert len(checks) == steps and max(checks) <= 1e-5, checks
    assert [m["staleness/max"] for m in hooks.seen] == [min(n, k) for n in range(steps)]
    hist = loop.state.history
    assert hist.versions() == list(range(steps - k, steps + 1))
    assert all(hist.get(v).export_adapter() is not None for v in hist.versions())
    assert hist.nbytes == (k + 1) * ADAPTER_BYTES
    assert [v for v, _, _ in rec.adapter_syncs] == [*range(1, steps - k), steps]
    # the checkpointed loop state keeps the adapters, and a resumed state reads them back
    saved = hooks.checkpoints[-1][1]["weight_history"]
    assert all(set(w) == {"lora_adapter"} for w in saved.values())
    back = LoopState.resume(hooks.checkpoints[-1][1]).history
    for v in hist.versions():
        a, b = hist.get(v).export_adapter(), back.get(v).export_adapter()
        assert a.settings == b.settings and all(torch.equal(a.tensors[n], b.tensors[n]) for n in a.tensors)
    # an engine without adapter sync gets a kept version merged into the learner's base
    merged = dict(hist.get(steps - 1).export_policy_weights())
    assert not any("lora_" in n for n in merged) and len(merged) == len(base.state_dict())


def test_copc_train_with_lora_through_the_sandbox_and_resume(tmp_path):
    out = tmp_path / "lora"
    args = overrides(out, "copc", steps=2, **{"learner.lora.rank": "4", "learner.lora.alpha": "8",
                                               "train.actor_lr": "1e-3"})
    summary = run_experiment(load_config(None, args))
    assert summary["steps"] == 2 and summary["trained_uids"] == 4
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "actor/pg_loss" in r] == [1, 2]
    ckpt = CheckpointManager(out / "checkpoints")
    state = ckpt.load(ckpt.latest())["learner"]
    assert "actor" not in state and "critic" not in state  # adapters (+ value head) only
    assert state["actor_lora"]["settings"]["rank"] == 4
    assert all("lora_" in n for n in state["actor_lora"]["tensors"])
    # resume with one more step: the adapter carries on from the checkpoint
    summary = run_experiment(load_config(None, overrides(out, "copc", steps=3, **{
        "learner.lora.rank": "4", "learner.lora.alpha": "8", "train.actor_lr": "1e-3"})), resume=True)
    assert summary["steps"] == 3 and summary["duplicate_trained_uids"] == 0
