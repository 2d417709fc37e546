"""The SGLang client held to SGLang's own code (issue 43 item 7).

Every request body :class:`~trainer.engines.sglang.SGLangEngine` sends (``/generate``, weight updates
from disk and by broadcast, the broadcast group, pause/continue, flush, LoRA load/unload) is captured
from the real client (an ``httpx`` transport records it; no SGLang server) and validated against
SGLang's own request dataclasses (``sglang/srt/managers/io_struct.py``) by
``sglang_io_struct_check.py``, run with the interpreter of ``.venv-sglang-types`` (the pinned ``sglang``
installed ``--no-deps`` by ``scripts/setup.sh --sglang-types``): no key SGLang does not know (FastAPI
would drop it silently), every required key present, each value accepted by pydantic as FastAPI
does, and ``/generate``'s ``sampling_params`` accepted by SGLang's ``SamplingParams`` with the
temperature / top-k / stops we meant. Then :func:`parse_generate_response` reads answers assembled
from SGLang's own pieces (finish reasons from its ``FINISH_*`` classes, log-prob triples from its
``detokenize_logprob_tokens``). Skipped, with the reason printed, where that virtualenv is missing.
"""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
from pathlib import Path

import httpx
import pytest

from trainer.engines.base import EngineError, SamplingParams
from trainer.engines.sglang import SGLangEngine, SGLangEngineConfig
from trainer.engines.sglang_protocol import build_generate_payload, parse_generate_response

ROOT = Path(__file__).resolve().parents[3]
SGLANG_PY = ROOT / ".venv-sglang-types" / "bin" / "python"
CHECKER = Path(__file__).with_name("sglang_io_struct_check.py")
#: the SGLang release the client is written against (the stand-in's /server_info; scripts/setup.sh)
SGLANG_VERSION = "0.5.6"
VOCAB = 1000
EOS = 2
TOP_K_ALL = 1 << 30  # sglang/srt/sampling/sampling_params.py: top_k -1 -> the whole vocabulary

pytestmark = pytest.mark.skipif(
    not SGLANG_PY.exists(),
    reason=f"{SGLANG_PY.relative_to(ROOT)} missing: `bash scripts/setup.sh --sglang-types` installs "
           f"sglang=={SGLANG_VERSION} --no-deps there (make test does)")

# no top-p / top-k < vocabulary: the SGLang engine refuses truncated sampling (its log-probs are the
# untruncated ones, test_sglang_protocol); top_k 1 is greedy, which keeps the untruncated convention
SAMPLINGS = [SamplingParams(),
             SamplingParams(temperature=0.7, max_new_tokens=8, stop=("</a>", "\n\n"), seed=3),
             SamplingParams(top_k=0, ignore_eos=True, max_new_tokens=3), SamplingParams(top_k=1)]


def sglang_answer(output_token_logprobs: list, finish_reason: dict, weight_version: str = "default") -> dict:
    """A non-streamed ``/generate`` answer as SGLang assembles it: ``TokenizerManager._handle_batch_output``
    (``srt/managers/tokenizer_manager.py``) builds ``meta_info`` = {id, finish_reason (the
    ``BaseFinishReason.to_json()`` of ``srt/managers/schedule_batch.py``), prompt_tokens,
    weight_version (``server_args.weight_version``, a str), total_retractions}, adds
    ``input_token_logprobs`` / ``output_token_logprobs`` in ``add_logprob_to_meta_info`` (triples from
    ``detokenize_logprob_tokens``), then completion_tokens, cached_tokens and, once finished,
    e2e_latency; the body is {text, output_ids (``Req.output_ids_through_stop``), meta_info}."""
    ids = [e[1] for e in output_token_logprobs]
    meta = {"id": "9f2c", "finish_reason": finish_reason, "prompt_tokens": 3,
            "weight_version": weight_version, "total_retractions": 0,
            "input_token_logprobs": [[None, 11, None]],
            "output_token_logprobs": output_token_logprobs, "completion_tokens": len(ids), "cached_tokens": 0,
            "e2e_latency": 0.05}
    return {"text": "ab", "output_ids": ids, "meta_info": meta}


class _Recorder(httpx.AsyncBaseTransport):
    """The server side of the HTTP exchange: records each request body, answers as SGLang does."""

    def __init__(self) -> None:
        self.sent: list[tuple[str, str, object]] = []

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        """Record (method, path, JSON body or None) and answer with SGLang's shape for the path."""
        raw = await request.aread()
        path = request.url.path
        self.sent.append((request.method, path, json.loads(raw) if raw else None))
        if path == "/generate":
            lps = [[-0.25, 7, None], [-0.5, EOS, None]]
            return httpx.Response(200, json=sglang_answer(lps, {"type": "stop", "matched": EOS}))
        if path == "/flush_cache":
            return httpx.Response(200, text="Cache flushed.\n")
        if path in ("/pause_generation", "/continue_generation"):
            return httpx.Response(200, json={"message": "ok", "status": "ok"})
        if path in ("/server_info", "/get_server_info"):
            return httpx.Response(200, json={"version": SGLANG_VERSION})
        return httpx.Response(200, json={"success": True, "message": "", "loaded_adapters": {}})


def _capture_bodies(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, str, object]]:
    """Drive every sending method of the real client; returns what went over the wire."""
    rec = _Recorder()
    real = httpx.AsyncClient
    monkeypatch.setattr(httpx, "AsyncClient", lambda *a, **kw: real(*a, **{**kw, "transport": rec}))

    async def run() -> None:
        eng = SGLangEngine(SGLangEngineConfig(base_url="http://sglang.invalid", forward_seed=True,
                                              vocab_size=VOCAB))
        for params in SAMPLINGS:
            await eng.generate([5, 6, 7], params)
        await eng.update_weights(tmp_path / "ckpt", 1)
        await eng.load_adapter(tmp_path / "adapter-2", 2)
        await eng.generate([5], SamplingParams(max_new_tokens=2))  # names the adapter (lora_path)
        await eng.load_adapter(tmp_path / "adapter-3", 3)  # unloads adapter 2
        await eng.flush_cache()
        await eng.init_weights_update_group("127.0.0.1", 29500, rank_offset=1, world_size=2)
        await eng.update_weights_from_distributed([("lm_head.weight", "torch.bfloat16", (4, 8))], 4)
        await eng.destroy_weights_update_group()
        await eng.server_info()
        await eng.close()
        for mode in ("abort", "retract", "in_place"):
            e = SGLangEngine(SGLangEngineConfig(base_url="http://sglang.invalid", pause_mode=mode))
            await e.pause()
            await e.resume()
            await e.close()

    asyncio.run(run())
    return rec.sent


def _run_checker(bodies: list[dict], logprobs: dict) -> dict:
    """Run sglang_io_struct_check.py in .venv-sglang-types (isolated: it sees only that venv)."""
    req = {"bodies": bodies, "logprobs": logprobs, "vocab_size": VOCAB, "eos_id": EOS, "stop_str": "</a>"}
    proc = subprocess.run([str(SGLANG_PY), "-I", str(CHECKER)], input=json.dumps(req), capture_output=True,
                          text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout)
    print(f"sglang {out['version']}; real `import sglang.srt.managers.io_struct`: "
          f"{out['import_error'] or 'ok'}")
    return out


def _client_endpoints() -> set[str]:
    """Every POST endpoint the client's source names (so a new one cannot go unchecked)."""
    src = "".join((ROOT / "trainer/engines" / f).read_text() for f in ("sglang.py", "sglang_lora.py"))
    return set(re.findall(r'"(/[a-z_]+)"', src)) - {"/server_info", "/get_server_info"}


def test_request_bodies_match_sglang_io_struct(tmp_path, monkeypatch):
    sent = _capture_bodies(tmp_path, monkeypatch)
    posted = [(path, body) for method, path, body in sent if method == "POST"]
    assert {p for p, _ in posted} == _client_endpoints()
    loras = [b.get("lora_path") for p, b in posted if p == "/generate"]
    assert loras == [None] * len(SAMPLINGS) + ["copc-1-v2"]
    # a greedy-temperature body (ours with T below SGLang's _SAMPLING_EPS) shows why the client refuses it
    tiny_t = build_generate_payload([5], SamplingParams(temperature=0.5))
    tiny_t["sampling_params"]["temperature"] = 1e-7
    bodies = [{"endpoint": p, "body": b} for p, b in posted] + [{"endpoint": "/generate", "body": tiny_t}]
    out = _run_checker(bodies, {"val": [-0.25, -0.5], "idx": [7, EOS]})
    assert out["version"] == SGLANG_VERSION
    results = out["results"]
    problems = [r for r in results if r["unknown"] or r["missing"] or r["error"]]
    assert not problems, json.dumps(problems, indent=1)
    by_endpoint: dict[str, list[dict]] = {}
    for r in results:
        by_endpoint.setdefault(r["endpoint"], []).append(r)
    assert by_endpoint["/update_weights_from_disk"][0]["class"] == "UpdateWeightFromDiskReqInput"
    assert by_endpoint["/flush_cache"][0]["class"] is None  # SGLang's handler takes no body
    assert [r["class"] for r in by_endpoint["/load_lora_adapter"]] == ["LoadLoRAAdapterReqInput"] * 2
    assert by_endpoint["/unload_lora_adapter"][0]["class"] == "UnloadLoRAAdapterReqInput"
    assert len(by_endpoint["/pause_generation"]) == 3
    # SGLang's own SamplingParams keeps exactly the sampling we asked for
    gen = by_endpoint["/generate"]
    assert len(gen) == len(SAMPLINGS) + 2
    for params, r in zip(SAMPLINGS, gen, strict=False):
        eff = r["effective_sampling"]
        assert eff["temperature"] == params.temperature and eff["top_p"] == params.top_p
        assert eff["top_k"] == (TOP_K_ALL if params.top_k in (0, -1) else params.top_k)
        assert eff["stop_strs"] == list(params.stop) and eff["max_new_tokens"] == params.max_new_tokens
        assert eff["no_stop_trim"] is True and eff["skip_special_tokens"] is False
        assert eff["ignore_eos"] is params.ignore_eos and r["return_text_in_logprobs"] is False
    assert gen[1]["effective_sampling"]["sampling_seed"] == 3
    assert gen[-1]["effective_sampling"]["temperature"] == 1.0 and gen[-1]["effective_sampling"]["top_k"] == 1
    with pytest.raises(ValueError, match="temperature=1e-07"):
        build_generate_payload([5], SamplingParams(temperature=1e-7))


def test_parser_reads_answers_built_from_sglang_code():
    out = _run_checker([], {"val": [-0.25, -1.5, -0.5], "idx": [7, 8, EOS]})
    lps, fr = out["output_token_logprobs"], out["finish_reasons"]
    assert lps == [[-0.25, 7, None], [-1.5, 8, None], [-0.5, EOS, None]]
    r = parse_generate_response(sglang_answer(lps, fr["eos"], "4"), 4, max_new_tokens=3, vocab_size=VOCAB)
    assert (r.token_ids, r.logprobs, r.versions) == ([7, 8, EOS], [-0.25, -1.5, -0.5], [4, 4, 4])
    assert r.finish_reason == "eos" and r.meta["matched"] == EOS and r.meta["weight_version"] == "4"
    assert r.meta["prompt_tokens"] == 3 and r.meta["completion_tokens"] == 3
    assert parse_generate_response(sglang_answer(lps, fr["stop"]), 0).finish_reason == "stop"
    assert parse_generate_response(sglang_answer(lps, fr["length"]), 0).finish_reason == "length"
    ab = parse_generate_response(sglang_answer([], fr["abort"]), 0)
    assert ab.finish_reason == "abort" and ab.meta["abort_message"] == "Abort before prefill"
    # Req._check_vocab_boundary_finish: an id outside the vocabulary (NaN logits) ends the request as a
    # "stop string" named "NaN happened"; that is a server failure, not a turn that met its stop string
    with pytest.raises(EngineError, match="NaN"):
        parse_generate_response(sglang_answer(lps, fr["nan"]), 0)

