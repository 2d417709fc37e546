"""SGLang engine without a server: the launcher's and engine's config validation, the exact
command line, the request payload built from :class:`~trainer.engines.base.SamplingParams` and the
parsing of SGLang's native ``/generate`` answers (finish reasons, malformed bodies). The same
code end to end over HTTP is in ``test_sglang.py``."""

from __future__ import annotations

import json

import pytest

from trainer.engines.base import EngineError, SamplingParams
from trainer.engines.builtin import sglang_preflight
from trainer.engines.registry import EngineCheck
from trainer.engines.sglang import SGLangEngineConfig
from trainer.engines.sglang_launcher import SGLangLauncherConfig, build_command
from trainer.engines.sglang_protocol import build_generate_payload, parse_generate_response
from trainer.errors import ConfigError

# ---------------------------------------------------------------- configs and command line

def test_launcher_config_validation_names_field(tmp_path):
    for kw, field in [({"tp": 0}, "tp"), ({"mem_fraction_static": 1.0}, "mem_fraction_static"),
                      ({"dtype": "fp8"}, "dtype"), ({"port": 70000}, "port"),
                      ({"random_seed": -1}, "random_seed"), ({"health_path": "/x"}, "health_path"),
                      ({"extra_env": {"SGLANG_RETURN_ORIGINAL_LOGPROB": "1"}}, "extra_env"),
                      ({"startup_timeout_s": 0}, "startup_timeout_s")]:
        with pytest.raises(ValueError, match=rf"SGLangLauncherConfig\.{field}="):
            SGLangLauncherConfig(model_path=str(tmp_path), **kw)
    with pytest.raises(ValueError, match="model_path"):
        SGLangLauncherConfig(model_path="")


def test_engine_config_validation_names_field():
    for kw, field in [({"base_url": "127.0.0.1:3000"}, "base_url"), ({"max_retries": -1}, "max_retries"),
                      ({"pause_mode": "stop"}, "pause_mode"),
                      ({"request_timeout_s": 0}, "request_timeout_s")]:
        with pytest.raises(ValueError, match=rf"SGLangEngineConfig\.{field}="):
            SGLangEngineConfig(**{"base_url": "http://127.0.0.1:1", **kw})


def test_build_command_exact():
    cfg = SGLangLauncherConfig(model_path="/ckpt/m", port=31000, tp=2, mem_fraction_static=0.7,
                               dtype="bfloat16", random_seed=7, sampling_backend="pytorch",
                               extra_args=("--log-level", "warning"), python="/usr/bin/python3")
    assert build_command(cfg, 31000) == [
        "/usr/bin/python3", "-m", "sglang.launch_server", "--model-path", "/ckpt/m",
        "--host", "127.0.0.1", "--port", "31000", "--tp-size", "2", "--mem-fraction-static", "0.7",
        "--dtype", "bfloat16", "--random-seed", "7", "--sampling-backend", "pytorch",
        "--log-level", "warning"]
    minimal = build_command(SGLangLauncherConfig(model_path="/m", python="py"), 5)
    assert minimal == ["py", "-m", "sglang.launch_server", "--model-path", "/m", "--host", "127.0.0.1",
                       "--port", "5", "--tp-size", "1", "--mem-fraction-static", "0.8"]
    # rollouts on GPUs 4..7 next to a learner on 0..3 (the paper-scale layout)
    split = build_command(SGLangLauncherConfig(model_path="/m", python="py", dp=4, base_gpu_id=4), 5)
    assert split[-4:] == ["--dp-size", "4", "--base-gpu-id", "4"]
    for field, bad in (("dp", 0), ("base_gpu_id", -1)):
        with pytest.raises(ValueError, match=field):
            SGLangLauncherConfig(model_path="/m", **{field: bad})


# ---------------------------------------------------------------- request mapping

def test_generate_payload_mapping():
    p = SamplingParams(temperature=0.7, top_p=1.0, top_k=0, max_new_tokens=12,
                       stop=("</code>", "</answer>"), seed=5, ignore_eos=True)
    body = build_generate_payload([1, 2, 3], p)
    assert body == {
        "input_ids": [1, 2, 3],
        "sampling_params": {"temperature": 0.7, "top_p": 1.0, "top_k": -1, "max_new_tokens": 12,
                            "stop": ["</code>", "</answer>"], "no_stop_trim": True, "ignore_eos": True,
                            "skip_special_tokens": False},
        "return_logprob": True, "logprob_start_len": -1, "top_logprobs_num": 0, "stream": False}
    seeded = build_generate_payload((4,), SamplingParams(top_k=-1, seed=5), forward_seed=True)
    assert seeded["sampling_params"]["sampling_seed"] == 5
    assert seeded["sampling_params"]["top_k"] == -1
    assert json.loads(json.dumps(seeded)) == seeded  # JSON-serialisable as is


@pytest.mark.parametrize("ids, match", [([], "prompt_ids"), ("abc", "prompt_ids"),
                                        ([1, -2], r"prompt_ids\[1\]"), ([1, 2.0], r"prompt_ids\[1\]")])
def test_generate_payload_rejects_bad_prompt(ids, match):
    with pytest.raises(ValueError, match=match):
        build_generate_payload(ids, SamplingParams())


@pytest.mark.parametrize("kw", [dict(top_p=0.9), dict(top_k=20), dict(top_k=5, top_p=0.5)])
def test_top_p_and_top_k_are_refused_naming_the_keys(kw):
    """SGLang reports untruncated log-probs (sampler.py, sgl-project/sglang#5961), not those of the
    top-k / top-p distribution it samples from, which the learner's ratios replay (issue 46 item 1):
    refused in the payload and in the engine's preflight (no GPU needed for the refusal)."""
    p = SamplingParams(temperature=0.7, **kw)
    with pytest.raises(ValueError, match=r"^rollout\.top_p=.* / rollout\.top_k=.* with rollout\.engine=sgl"):
        build_generate_payload([1], p)
    with pytest.raises(ConfigError, match=r"rollout\.engine=sglang: SGLang reports untruncated"):
        sglang_preflight(EngineCheck(sampling=p))
    assert build_generate_payload([1], SamplingParams(top_k=1, top_p=0.5))["sampling_params"]["top_k"] == 1


def test_generate_payload_rejects_greedy_topk_with_temperature():
    with pytest.raises(ValueError, match=r"top_k=1 with temperature=0.5"):
        build_generate_payload([1], SamplingParams(top_k=1, temperature=0.5))
    assert build_generate_payload([1], SamplingParams(top_k=1))["sampling_params"]["top_k"] == 1


# ---------------------------------------------------------------- response parsing

def _resp(entries, finish, **extra):
    return {"text": "xy", "meta_info": {"finish_reason": finish, "output_token_logprobs": entries,
                                        "completion_tokens": len(entries or [])}, **extra}


def test_parse_response_fields_and_finish_reasons():
    r = parse_generate_response(_resp([[-0.5, 7, None], [-1.25, 2, "b"]], {"type": "stop", "matched": 2},
                                      output_ids=[7, 2]), version=3)
    assert (r.token_ids, r.logprobs, r.versions, r.finish_reason, r.text) == (
        [7, 2], [-0.5, -1.25], [3, 3], "eos", "xy")
    assert r.meta["matched"] == 2 and r.meta["completion_tokens"] == 2
    assert parse_generate_response(_resp([[-0.1, 5]], {"type": "stop", "matched": "</code>"}),
                                   0).finish_reason == "stop"
    assert parse_generate_response(_resp([[-0.1, 5]], {"type": "length", "length": 1}),
                                   0).finish_reason == "length"
    ab = parse_generate_response(_resp([], {"type": "abort", "message": "paused"}), 0)
    assert (ab.finish_reason, ab.token_ids, ab.meta["abort_message"]) == ("abort", [], "paused")
    # batch-of-one list form is accepted
    assert parse_generate_response([_resp([[-0.1, 5]], {"type": "length"})], 1).versions == [1]


@pytest.mark.parametrize("body, match", [
    ("oops", "expected a JSON object"),
    ({"error": {"message": "input too long"}}, "input too long"),
    ({"text": "x"}, "meta_info"),
    (_resp(None, {"type": "length"}), "output_token_logprobs missing"),
    (_resp([[-0.1]], {"type": "length"}), r"output_token_logprobs\[0\]"),
    (_resp([[-0.1, 1], ["x", 2]], {"type": "length"}), r"output_token_logprobs\[1\]\[0\]"),
    (_resp([[0.7, 1]], {"type": "length"}), r"\[0\]\[0\]=0.7"),
    (_resp([[float("nan"), 1]], {"type": "length"}), r"\[0\]\[0\]=nan"),
    (_resp([[float("-inf"), 1]], {"type": "length"}), r"\[0\]\[0\]=-inf"),  # not a finite log-prob
    (_resp([[-0.1, -4]], {"type": "length"}), r"\[0\]\[1\]=-4"),
    (_resp([[-0.1, 1]], None), "finish_reason=None"),
    (_resp([[-0.1, 1]], {"type": "stop"}), "matched"),
    (_resp([[-0.1, 1]], {"type": "done"}), "finish_reason"),
    (_resp([[-0.1, 1]], {"type": "length"}, output_ids=[2]), "output_ids"),
])
def test_parse_response_malformed_raises_engine_error(body, match):
    with pytest.raises(EngineError, match=match):
        parse_generate_response(body, 0)


def test_parse_response_too_many_tokens():
    with pytest.raises(EngineError, match="max_new_tokens=1"):
        parse_generate_response(_resp([[-0.1, 1], [-0.1, 1]], {"type": "length"}), 0, max_new_tokens=1)
