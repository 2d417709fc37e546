"""SGLang LoRA adapter sync: the launcher's LoRA flags, and the real ``sglang`` engine factory + HTTP client
end to end against the PROTOCOL STAND-IN (tests/trainer/sglang_protocol_standin, see test_sglang.py):
the initial adapter is loaded at start-up (``--lora-paths``), a sync writes a PEFT directory and calls
``/load_lora_adapter``, requests name their version's adapter (``lora_path``), requests in flight keep
the old adapter and version, the old adapter is unloaded once they are done, refusals leave the served
version as it was. The stand-in's log-probs depend on the adapter's tensors, so a test that passes
shows the tensors the client wrote are those the server serves.
"""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path

import pytest
import torch

from trainer.engines import EngineSpec, SGLangSettings, make_engine
from trainer.engines.base import EngineError, SamplingParams
from trainer.engines.sglang_launcher import SGLangLauncherConfig, build_command, free_port
from trainer.models.lora import AdapterWeights, LoraSettings, inject_lora
from trainer.models.tiny import TinyModelConfig, build_byte_tokenizer, build_tiny_model

from .test_sglang import STANDIN_DIR, _log, standin

LORA = LoraSettings(rank=4, alpha=8.0, target_modules=("q_proj", "v_proj"))


def test_build_command_with_lora_flags():
    cfg = SGLangLauncherConfig(model_path="/m", python="py", lora_max_rank=16,
                               lora_target_modules=("q_proj", "v_proj"), lora_paths=("copc-0-v3=/a/lora_v3",))
    assert build_command(cfg, 5)[-10:] == [
        "--enable-lora", "--max-lora-rank", "16", "--lora-target-modules", "q_proj", "v_proj",
        "--max-loras-per-batch", "2", "--lora-paths", "copc-0-v3=/a/lora_v3"]
    for kw, field in [({"lora_max_rank": 0, "lora_target_modules": ("q_proj",)}, "lora_max_rank"),
                      ({"lora_max_rank": 8}, "lora_target_modules"),
                      ({"lora_target_modules": ("q_proj",)}, "lora_max_rank"),
                      ({"lora_max_rank": 8, "lora_target_modules": ("q_proj",), "lora_paths": ("x",)},
                       "lora_paths")]:
        with pytest.raises(ValueError, match=rf"SGLangLauncherConfig\.{field}="):
            SGLangLauncherConfig(model_path="/m", **kw)


def _adapter(seed: int, settings: LoraSettings = LORA) -> AdapterWeights:
    """A trained-looking adapter of a tiny Qwen2 model (random A and B)."""
    tok = build_byte_tokenizer()
    model = inject_lora(build_tiny_model(TinyModelConfig(hidden_size=32, intermediate_size=64, num_layers=1),
                                         len(tok), tok.eos_token_id, tok.pad_token_id), settings)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_" in n:
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    return AdapterWeights.of(model, settings).copy()


def _phase(model_path: str, adapter: AdapterWeights) -> float:
    """The stand-in's logit phase for requests on ``adapter`` (base path + adapter tensors)."""
    base = (sum(model_path.encode()) % 97) * 0.05
    return base + standin.adapter_phase({k: v.numpy() for k, v in adapter.tensors.items()})


def _expected(prompt, result, phase, temperature):
    prev, out = prompt[-1], []
    for tok in result.token_ids:
        out.append(standin.log_softmax([x / temperature for x in standin.logits(prev, phase)])[tok])
        prev = tok
    return out


def _tokenizer():
    """A real tokenizer of the stand-in's 260-token vocabulary (256 bytes, 4 specials)."""
    tok = build_byte_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": ["<|s258|>", "<|s259|>"]})
    assert len(tok) == standin.VOCAB
    return tok


def _info(url):
    import httpx
    return httpx.get(f"{url}/server_info").json()


@pytest.fixture
def standin_path(monkeypatch):
    """The stand-in first on the PYTHONPATH the factory's launcher passes to the server."""
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(STANDIN_DIR), os.environ.get("PYTHONPATH", "")]))
    monkeypatch.setenv("STANDIN_TOKEN_DELAY_S", "0.003")


def test_sglang_factory_syncs_adapters_only_and_versions_follow(tmp_path, standin_path):
    base = tmp_path / "base"
    base.mkdir()
    a0, a1, a2 = _adapter(0), _adapter(1), _adapter(2)
    spec = EngineSpec(base, _tokenizer(), 3, adapter=a0, work_dir=tmp_path,
                      settings=SGLangSettings(port=free_port()))
    handle = make_engine("sglang", spec)
    engine, url = handle.engine, handle.engine.config.base_url
    p = SamplingParams(temperature=0.7, max_new_tokens=8, ignore_eos=True)
    root = tmp_path / "sglang_weights"

    async def scenario():
        try:
            info = _info(url)
            assert info["argv"][info["argv"].index("--enable-lora"):] == [
                "--enable-lora", "--max-lora-rank", "4", "--lora-target-modules", "q_proj", "v_proj",
                "--max-loras-per-batch", "2", "--lora-paths", f"copc-0-v3={root / 'lora_v3'}"]
            r0 = await engine.generate([72, 105], p)
            assert r0.versions == [3] * 8
            assert r0.logprobs == pytest.approx(_expected([72, 105], r0, _phase(str(base), a0), 0.7),
                                                abs=1e-9)
            await handle.sync_adapter(a1, 4)
            assert engine.version == 4 and not (root / "lora_v3").exists() and (root / "lora_v4").is_dir()
            r1 = await engine.generate([72, 105], p)
            assert r1.versions == [4] * 8
            assert r1.logprobs == pytest.approx(_expected([72, 105], r1, _phase(str(base), a1), 0.7),
                                                abs=1e-9)
            # a request in flight keeps its adapter and version; the old adapter goes once it is done
            long = SamplingParams(temperature=0.7, max_new_tokens=60, ignore_eos=True)
            early = asyncio.create_task(engine.generate([7], long))
            await asyncio.sleep(0.05)
            await handle.sync_adapter(a2, 5)
            late = await engine.generate([7], p)
            assert not early.done() and "copc-1-v4" in _info(url)["loaded_loras"]
            e = await early
            assert e.versions == [4] * 60 and late.versions == [5] * 8
            assert e.logprobs == pytest.approx(_expected([7], e, _phase(str(base), a1), 0.7), abs=1e-9)
            assert late.logprobs == pytest.approx(_expected([7], late, _phase(str(base), a2), 0.7), abs=1e-9)
            # refusals leave the served adapter and version as they were
            big = _adapter(3, LoraSettings(rank=8, alpha=8.0, target_modules=("q_proj",)))
            with pytest.raises(EngineError,
                               match=r"load_lora_adapter -> HTTP 400.*greater than max_lora_rank 4"):
                await handle.sync_adapter(big, 6)
            other = _adapter(4, LoraSettings(rank=4, alpha=8.0, target_modules=("q_proj", "o_proj")))
            with pytest.raises(EngineError, match=r"module 'o_proj' is not in --lora-target-modules"):
                await handle.sync_adapter(other, 6)
            assert engine.version == 5
            r = await engine.generate([72, 105], p)
            assert r.versions == [5] * 8
        finally:
            await handle.close()

    asyncio.run(scenario())


def test_sglang_adapter_requests_over_http_in_order(tmp_path, standin_path):
    """The request sequence the client sends: loads, requests naming the adapter, unloads after."""
    base = tmp_path / "base"
    base.mkdir()
    a0, a1 = _adapter(0), _adapter(1)
    handle = make_engine("sglang", EngineSpec(base, _tokenizer(), 0, adapter=a0, work_dir=tmp_path,
                                              settings=SGLangSettings(port=free_port())))
    engine, url = handle.engine, handle.engine.config.base_url
    p = SamplingParams(max_new_tokens=3, ignore_eos=True)

    async def scenario():
        try:
            await engine.generate([1], p)
            await handle.sync_adapter(a1, 1)
            await engine.generate([1], p)
            await engine.adapters.close()  # the old adapter's unload has been sent
            return _log(url), _info(url)["loaded_loras"]
        finally:
            await handle.close()

    log, loaded = asyncio.run(scenario())
    log = [x for x in log if x["path"] not in ("/server_info", "/health")]
    paths = [x["path"] for x in log]
    # nothing was in flight on the old adapter: its unload may come before the next request
    assert paths[:2] == ["/generate", "/load_lora_adapter"]
    assert sorted(paths[2:]) == ["/generate", "/unload_lora_adapter"]
    bodies = {x["path"]: json.loads(x["body"]) for x in log[1:]}
    assert json.loads(log[0]["body"])["lora_path"] == "copc-0-v0"
    assert bodies["/generate"]["lora_path"] == "copc-1-v1"
    assert bodies["/load_lora_adapter"] == {"lora_name": "copc-1-v1",
                                            "lora_path": str(tmp_path / "sglang_weights" / "lora_v1")}
    assert bodies["/unload_lora_adapter"] == {"lora_name": "copc-0-v0"}
    assert list(loaded) == ["copc-1-v1"]
    # the directory the server loaded is a standard PEFT adapter of these tensors
    from safetensors.torch import load_file
    cfg = json.loads((tmp_path / "sglang_weights" / "lora_v1" / "adapter_config.json").read_text())
    assert (cfg["peft_type"], cfg["r"], cfg["lora_alpha"], sorted(cfg["target_modules"])) == (
        "LORA", 4, 8.0, ["q_proj", "v_proj"])
    saved = load_file(str(Path(tmp_path) / "sglang_weights" / "lora_v1" / "adapter_model.safetensors"))
    assert {k.removeprefix("base_model.model."): v for k, v in saved.items()}.keys() == a1.tensors.keys()
    assert all(torch.equal(saved["base_model.model." + k], v) for k, v in a1.tensors.items())
