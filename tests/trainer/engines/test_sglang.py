"""SGLang engine: the real launcher + HTTP client end to end against a PROTOCOL STAND-IN server
(tests/trainer/sglang_protocol_standin/sglang/launch_server.py). The stand-in is started by our
SGLangLauncher as ``python -m sglang.launch_server`` (stand-in first on PYTHONPATH); it
answers SGLang's native endpoints in the documented shapes. It is not SGLang and not a mock
of our code. The live test against real SGLang is marked ``gpu``. The request/response mapping
and the launcher's command line without a server: ``test_sglang_protocol.py``.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import math
import os
import re
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from trainer.engines.base import EngineError, SamplingParams
from trainer.engines.sglang import SGLangEngine, SGLangEngineConfig
from trainer.engines.sglang_launcher import (
    SGLangLauncher,
    SGLangLauncherConfig,
    SGLangLaunchError,
    free_port,
)
from trainer.engines.sglang_protocol import build_generate_payload

STANDIN_DIR = Path(__file__).parent.parent / "sglang_protocol_standin"
_spec = importlib.util.spec_from_file_location("sglang_standin_model",
                                               STANDIN_DIR / "sglang" / "launch_server.py")
standin = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(standin)  # the stand-in's reference model: logits(), log_softmax()
EOS = standin.EOS


def _dead(pid: int) -> bool:
    """True once ``pid`` no longer exists (or is a zombie)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except (FileNotFoundError, IndexError):
        return True


def _wait_dead(pid: int, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if _dead(pid):
            return True
        time.sleep(0.05)
    return False


def _standin_cfg(model_dir: Path, **kw) -> SGLangLauncherConfig:
    env = {"PYTHONPATH": os.pathsep.join([str(STANDIN_DIR), os.environ.get("PYTHONPATH", "")]),
           **kw.pop("extra_env", {})}
    return SGLangLauncherConfig(model_path=str(model_dir), extra_env=env, show_progress=False,
                                poll_interval_s=0.1, shutdown_grace_s=5.0, **kw)


# ---------------------------------------------------------------- real launcher + stand-in

@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """The stand-in started by the real SGLangLauncher (module-scoped)."""
    model = tmp_path_factory.mktemp("ckpt-v0")
    cfg = _standin_cfg(model, random_seed=11, dtype="float32",
                       extra_env={"STANDIN_TOKEN_DELAY_S": "0.002"})
    with SGLangLauncher(cfg) as launcher:
        yield launcher


def _run(coro_fn, url, backoff_s_override=0.01, **cfg):
    async def main():
        eng = SGLangEngine(SGLangEngineConfig(base_url=url, backoff_s=backoff_s_override, **cfg))
        try:
            return await coro_fn(eng)
        finally:
            await eng.close()
    return asyncio.run(main())


def _control(url, **kw):
    import httpx
    httpx.post(f"{url}/_standin/control", json={"reset": True, **kw}).raise_for_status()


def _log(url):
    import httpx
    return httpx.get(f"{url}/_standin/requests").json()


def test_launcher_passes_command_line(server):
    import httpx
    info = httpx.get(server.url + "/server_info").json()
    assert info["argv"] == server.command[3:]
    assert "--random-seed" in info["argv"] and info["random_seed"] == 11
    assert server.running and str(server.port) in server.url


def test_generate_logprobs_aligned_with_reference(server):
    _control(server.url)
    prompt = [72, 105]
    params = SamplingParams(temperature=0.7, max_new_tokens=16)  # top-p / top-k: refused
    r = _run(lambda e: e.generate(prompt, params), server.url)
    assert 1 <= len(r.token_ids) <= 16 and r.versions == [0] * len(r.token_ids)
    phase = (sum(server.config.model_path.encode()) % 97) * 0.05
    prev = prompt[-1]
    for tok, lp in zip(r.token_ids, r.logprobs, strict=True):
        ref = standin.log_softmax([x / 0.7 for x in standin.logits(prev, phase)])[tok]
        assert lp == pytest.approx(ref, abs=1e-12)
        prev = tok
    sent = json.loads(_log(server.url)[-1]["body"])
    assert sent == build_generate_payload(prompt, params)


def test_finish_reasons_over_http(server):
    url = server.url
    _control(url, script=[[65, 66, EOS]])
    r = _run(lambda e: e.generate([1], SamplingParams(max_new_tokens=8)), url)
    assert (r.token_ids, r.finish_reason) == ([65, 66, EOS], "eos")
    _control(url, script=[[65, 66, 67, 68]])
    r = _run(lambda e: e.generate([1], SamplingParams(stop=("AB",), max_new_tokens=8)), url)
    assert (r.token_ids, r.finish_reason, r.text) == ([65, 66], "stop", "AB")
    _control(url, script=[[65, 66, 67, 68]])
    r = _run(lambda e: e.generate([1], SamplingParams(max_new_tokens=3)), url)
    assert (r.token_ids, r.finish_reason) == ([65, 66, 67], "length")


def test_retries_on_5xx_then_succeeds(server):
    _control(server.url, fail=[503, 502])
    r = _run(lambda e: e.generate([1], SamplingParams(max_new_tokens=2)), server.url, max_retries=3)
    assert len(r.token_ids) == 2
    assert [x["path"] for x in _log(server.url)] == ["/generate"] * 3


def test_retries_exhausted_and_4xx_not_retried(server):
    _control(server.url, fail=[503] * 5)
    with pytest.raises(EngineError, match=r"failed after 3 attempt\(s\); last error: HTTP 503"):
        _run(lambda e: e.generate([1], SamplingParams(max_new_tokens=2)), server.url, max_retries=2)
    assert len(_log(server.url)) == 3
    _control(server.url, fail=[400])
    with pytest.raises(EngineError, match="HTTP 400"):
        _run(lambda e: e.generate([1], SamplingParams()), server.url, max_retries=3)
    assert len(_log(server.url)) == 1


def test_connection_refused_is_engine_error():
    url = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(EngineError, match=r"failed after 2 attempt\(s\); last error: ConnectError"):
        _run(lambda e: e.generate([1], SamplingParams()), url, max_retries=1)


def test_malformed_answer_over_http(server):
    _control(server.url, respond=[{"text": "no meta"}])
    with pytest.raises(EngineError, match="meta_info"):
        _run(lambda e: e.generate([1], SamplingParams()), server.url)


def test_request_timeout_is_a_total_deadline(server):
    """A server that trickles one byte every 50 ms never trips a per-read timeout of 1 s; the
    call still fails once ``request_timeout_s`` has passed in all (issue 21 item 11)."""
    _control(server.url, trickle_s=0.05)
    t0 = time.monotonic()
    with pytest.raises(EngineError, match=r"no complete answer within request_timeout_s=1 s"):
        _run(lambda e: e.generate([1], SamplingParams(max_new_tokens=2)), server.url, request_timeout_s=1.0)
    assert 0.9 < time.monotonic() - t0 < 3.0
    _control(server.url)  # the server is usable again at once
    assert len(_run(lambda e: e.generate([1], SamplingParams(max_new_tokens=2)), server.url).token_ids) == 2


def test_retries_share_one_deadline(tmp_path):
    """Retries and back-off count against the same deadline: with a 1 s deadline and 0.4 s,
    0.8 s, ... back-off, a refused connection gives up after ~1 s, not after every retry."""
    url = f"http://127.0.0.1:{free_port()}"
    t0 = time.monotonic()
    with pytest.raises(EngineError, match=r"attempt\(s\); last error: ConnectError.*request_timeout_s=1 s"):
        _run(lambda e: e.generate([1], SamplingParams()), url, max_retries=10, request_timeout_s=1.0,
             backoff_s_override=0.4)
    assert time.monotonic() - t0 < 2.0


def test_out_of_vocabulary_token_is_engine_error(server):
    """A token id the policy tokenizer does not have is an EngineError naming it (so the
    episode is an infrastructure failure), never an IndexError later in decoding."""
    body = {"text": "x", "meta_info": {"finish_reason": {"type": "length", "length": 2},
                                       "output_token_logprobs": [[-0.5, 65, None], [-0.1, 300, None]]}}
    _control(server.url, respond=[body, body])
    with pytest.raises(EngineError, match=r"output_token_logprobs\[1\]\[1\]=300: outside the tokenizer's "
                                          r"vocabulary \(size 260\)"):
        _run(lambda e: e.generate([1], SamplingParams(max_new_tokens=2)), server.url, vocab_size=260)
    r = _run(lambda e: e.generate([1], SamplingParams(max_new_tokens=2)), server.url)  # unchecked
    assert r.token_ids == [65, 300]


def test_update_weights_from_disk_then_flush(server, tmp_path):
    url = server.url
    new = tmp_path / "ckpt-v1-longer-name"
    new.mkdir()
    _control(url, script=[[65, 66]])
    params = SamplingParams(max_new_tokens=2)

    async def scenario(e):
        before = await e.generate([1], params)
        await e.update_weights(new, 1)
        after = await e.generate([1], SamplingParams(max_new_tokens=2))
        return before, after, e.version

    _control(url, script=[[65, 66], [65, 66]])
    before, after, version = _run(scenario, url)
    assert version == 1 and before.versions == [0, 0] and after.versions == [1, 1]
    assert after.meta["weight_version"] == "1"
    assert after.logprobs != pytest.approx(before.logprobs)  # new weights, same tokens
    log = _log(url)
    assert [x["path"] for x in log] == ["/generate", "/update_weights_from_disk", "/flush_cache", "/generate"]
    assert json.loads(log[1]["body"]) == {"model_path": str(new), "weight_version": "1"}

    async def bad(e):
        with pytest.raises(EngineError, match=r"update_weights_from_disk -> HTTP 400.*no such path"):
            await e.update_weights(tmp_path / "missing", 2)
        with pytest.raises(ValueError, match="checkpoint directory path"):
            await e.update_weights({"w": 0}, 2)
        with pytest.raises(ValueError, match="version"):
            await e.update_weights(new, -1)
        return e.version
    assert _run(bad, url, initial_version=1) == 1
    _run(lambda e: e.update_weights(server.config.model_path, 0), url)  # restore v0 weights


def test_update_waits_for_inflight_requests(server, tmp_path):
    """Requests admitted before an update finish on the old version; requests issued
    while it runs wait and get the new one; the server sees no overlap."""
    url = server.url
    _control(url)

    async def scenario(e):
        p = SamplingParams(max_new_tokens=40, ignore_eos=True)
        early = [asyncio.create_task(e.generate([i + 1], p)) for i in range(4)]
        await asyncio.sleep(0.02)
        upd = asyncio.create_task(e.update_weights(server.config.model_path, 5))
        await asyncio.sleep(0)
        late = asyncio.create_task(e.generate([9], p))
        await upd
        return await asyncio.gather(*early), await late

    early, late = _run(scenario, url)
    assert all(r.versions == [0] * 40 for r in early) and late.versions == [5] * 40
    paths = [x["path"] for x in _log(url)]
    assert paths == ["/generate"] * 4 + ["/update_weights_from_disk", "/flush_cache", "/generate"]
    _run(lambda e: e.update_weights(server.config.model_path, 0), url)


def test_pause_resume(server):
    url = server.url
    _control(url, script=[[65, 66]])  # scripted tokens: a sampled EOS could end the request early

    async def scenario(e):
        await e.pause()
        task = asyncio.create_task(e.generate([3], SamplingParams(max_new_tokens=2)))
        await asyncio.sleep(0.3)
        seen_while_paused = [x["path"] for x in _log(url)]
        assert not task.done()
        await e.resume()
        return seen_while_paused, await task

    seen, r = _run(scenario, url)
    assert seen == ["/pause_generation"] and len(r.token_ids) == 2
    log = _log(url)
    assert [x["path"] for x in log] == ["/pause_generation", "/continue_generation", "/generate"]
    assert json.loads(log[0]["body"]) == {"mode": "retract"}


def test_distributed_weight_update_mapping(server):
    import torch
    url = server.url
    _control(url)

    async def scenario(e):
        await e.init_weights_update_group("10.0.0.1", 29500, 1, 3)
        await e.update_weights_from_distributed(
            [("model.w", torch.bfloat16, (2, 3)), ("model.b", "float32", [3])], version=4)
        await e.destroy_weights_update_group()
        with pytest.raises(ValueError, match=r"params\[0\]"):
            await e.update_weights_from_distributed([("w", "float32")], version=5)
        with pytest.raises(ValueError, match="rank_offset"):
            await e.init_weights_update_group("h", 1, 0, 2)
        return e.version

    assert _run(scenario, url) == 4
    log = _log(url)
    assert [json.loads(x["body"]) for x in log] == [
        {"master_address": "10.0.0.1", "master_port": 29500, "rank_offset": 1, "world_size": 3,
         "group_name": "weight_update_group", "backend": "nccl"},
        {"names": ["model.w", "model.b"], "dtypes": ["bfloat16", "float32"], "shapes": [[2, 3], [3]],
         "group_name": "weight_update_group", "flush_cache": True, "weight_version": "4"},
        {"group_name": "weight_update_group"}]


def test_server_info_version_check(server):
    info = _run(lambda e: e.server_info(), server.url)
    assert info["version"] == "0.5.6"


# ---------------------------------------------------------------- launcher lifecycle

def _child_pid(text: str) -> int:
    return int(re.search(r"stand-in child pid=(\d+)", text).group(1))


def test_launcher_crash_surfaces_log_tail(tmp_path):
    launcher = SGLangLauncher(_standin_cfg(tmp_path, extra_env={"STANDIN_MODE": "crash"}))
    with pytest.raises(SGLangLaunchError, match=r"(?s)exited with status 3.*CUDA out of memory"):
        launcher.start()
    assert _wait_dead(_child_pid(launcher.log_tail())) and not launcher.running


def test_launcher_timeout_kills_group(tmp_path):
    # 10 s: the stand-in must have printed its "hanging" line by then, also on a loaded machine
    launcher = SGLangLauncher(_standin_cfg(tmp_path, startup_timeout_s=10.0,
                                           extra_env={"STANDIN_MODE": "hang"}))
    with pytest.raises(SGLangLaunchError, match=r"(?s)not healthy .* after 10 s.*hanging before serving"):
        launcher.start()
    assert _wait_dead(launcher.proc.pid) and _wait_dead(_child_pid(launcher.log_tail()))


def test_launcher_missing_model_path(tmp_path):
    with pytest.raises(ValueError, match=r"model_path=.*not a directory"):
        SGLangLauncher(SGLangLauncherConfig(model_path=str(tmp_path / "nope"))).start()


def test_close_kills_whole_group_and_is_idempotent(tmp_path):
    launcher = SGLangLauncher(_standin_cfg(tmp_path)).start()
    child = _child_pid(launcher.log_tail())
    assert not _dead(child)
    launcher.close()
    launcher.close()
    assert _wait_dead(launcher.proc.pid) and _wait_dead(child)


def test_interpreter_exit_leaves_no_orphan(tmp_path):
    """A script that starts a server and exits without close() leaves nothing running."""
    script = textwrap.dedent(f"""
        import json, re, sys
        sys.path.insert(0, {str(Path(__file__).parent.resolve().parents[2])!r})
        from trainer.engines.sglang_launcher import SGLangLauncher, SGLangLauncherConfig
        cfg = SGLangLauncherConfig(model_path={str(tmp_path)!r}, show_progress=False,
                                   poll_interval_s=0.1, shutdown_grace_s=5.0,
                                   extra_env={{"PYTHONPATH": {str(STANDIN_DIR)!r}}})
        launcher = SGLangLauncher(cfg).start()
        child = int(re.search(r"child pid=(\\d+)", launcher.log_tail()).group(1))
        print(json.dumps([launcher.proc.pid, child]), flush=True)
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    leader, child = json.loads(out.stdout.strip().splitlines()[-1])
    assert _wait_dead(leader) and _wait_dead(child)


# ---------------------------------------------------------------- live SGLang (GPU)

@pytest.mark.gpu
def test_live_sglang_logprobs_match_transformers(tmp_path):
    """Real SGLang on the tiny model at $COPC_SGLANG_TEST_MODEL (fp32): the log-prob of
    every generated token equals log_softmax(logits / T) of a transformers forward pass
    over prompt + response, within 1e-3, with T=0.7 and top-p=0.9."""
    model_path = os.environ.get("COPC_SGLANG_TEST_MODEL")
    if importlib.util.find_spec("sglang") is None:
        pytest.skip("sglang is not installed (pip install -e .[gpu])")
    if not model_path or not Path(model_path).is_dir():
        pytest.skip("set COPC_SGLANG_TEST_MODEL to a local tiny checkpoint directory")
    import torch
    from transformers import AutoModelForCausalLM

    from trainer.logprobs import token_logprobs  # the learner's definition

    cfg = SGLangLauncherConfig(model_path=model_path, dtype="float32", mem_fraction_static=0.3,
                               random_seed=0, attention_backend=os.environ.get(
                                   "COPC_SGLANG_TEST_ATTENTION", "torch_native"),
                               extra_args=("--disable-cuda-graph",), startup_timeout_s=600,
                               log_path=str(tmp_path / "server.log"))
    prompt = [1, 5, 9, 14, 3]
    params = SamplingParams(temperature=0.7, max_new_tokens=24, ignore_eos=True)
    with SGLangLauncher(cfg) as server:
        results = _run(lambda e: asyncio.gather(*(e.generate(prompt, params) for _ in range(3))),
                       server.url)
    model = AutoModelForCausalLM.from_pretrained(model_path, torch_dtype=torch.float32).cuda().eval()
    for r in results:
        assert len(r.token_ids) == 24 and r.finish_reason == "length"
        ids = torch.tensor([prompt + r.token_ids], device="cuda")
        with torch.no_grad():
            logits = model(ids).logits[0, len(prompt) - 1:-1].float()
        ref = token_logprobs(logits, torch.tensor(r.token_ids, device="cuda"), temperature=0.7)
        diff = (ref.cpu() - torch.tensor(r.logprobs)).abs().max().item()
        assert diff < 1e-3, f"max |Δ log-prob| = {diff}"
        assert all(math.isfinite(x) for x in r.logprobs)
