"""``copc env serve`` against hostile or unlucky clients (found by trying to break issue 15's server):

* a JSON body / WebSocket message nested deeper than Python's parser follows is the client's
  fault — 400 ``INVALID_JSON`` naming ``body`` / ``message`` — not a 500 blamed on the environment;
* an action holding a lone UTF-16 surrogate (JSON's ``"\\ud800"`` escape) is refused with 422
  naming ``data.text`` and the episode goes on (it used to reach the sandbox, which raised: 500);
* the longest action the environment accepts always reaches it: JSON ASCII-escapes a character
  outside the BMP as 12 bytes (``\\ud83d\\ude00``), and the default message limit (8 bytes per
  character) closed the connection (1009) on 65,536 emoji, an infrastructure failure of a valid
  action;
* ``copc env serve`` of an environment whose service dies at start (an MCP server) prints one
  line and exits with status 1 instead of a traceback;
* a client that is gone before the server closes its socket (here: while the session's broken
  environment is being closed) does not make the ASGI server log ``Exception in ASGI
  application`` (``WebSocketDisconnect`` escaped the handler), and the session is freed.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from websockets.sync.client import connect

import environments
from environments.remote.launch import REPO, start_env_server

SAMPLE = {"id": "m1", "problem": "What is 12 * 34?", "answer": "408"}
DEEP = "[" * 100_000 + "]" * 100_000  # valid JSON, deeper than json.loads' recursion limit

SLOW_CLOSE_ENV = '''
import time
import environments
from environments.base import ToolEnv


class SlowCloseEnv(ToolEnv):
    """Every step raises (an environment bug); closing takes 1 s."""

    def __init__(self):
        super().__init__([], invalid_action_reply="?")

    def build_prompt(self, sample):
        return "prompt"

    def step(self, action):
        raise RuntimeError("boom")

    def close(self):
        time.sleep(1.0)


environments.register("slowclose", SlowCloseEnv)
'''


@pytest.fixture(scope="module")
def math_server():
    server = start_env_server("math_tool", "reward.mode=dapo_strict")
    yield server
    server.stop()


def ws_url(url: str) -> str:
    return url.replace("http://", "ws://") + "/ws"


def exchange(ws, message) -> dict:
    ws.send(message if isinstance(message, str) else json.dumps(message))
    return json.loads(ws.recv(timeout=60))


def test_deeply_nested_json_is_a_400_naming_the_field(math_server):
    r = httpx.post(f"{math_server.url}/reset", content=DEEP, timeout=30)
    assert r.status_code == 400
    assert r.json() == {"code": "INVALID_JSON", "field": "body",
                        "detail": "request body is nested too deeply for the server's JSON parser "
                                  "(not accepted as JSON)"}
    with connect(ws_url(math_server.url), max_size=None) as ws:
        frame = exchange(ws, DEEP)
        assert frame == {"type": "error", "data": {
            "code": "INVALID_JSON", "status": 400, "field": "message",
            "message": "message is nested too deeply for the server's JSON parser (not accepted as JSON)"}}
        # the session goes on
        frame = exchange(ws, {"type": "reset", "data": {"sample": SAMPLE}})
        assert frame["type"] == "observation" and "What is 12 * 34?" in frame["data"]["observation"]["text"]
        frame = exchange(ws, {"type": "step", "data": {"text": "<code>print(12 * 34)</code>"}})
        assert frame["data"]["observation"]["text"] == "\n<interpreter>\n408\n</interpreter>\n"


def test_lone_surrogate_action_is_a_422_and_the_episode_goes_on(math_server):
    with connect(ws_url(math_server.url)) as ws:
        assert exchange(ws, {"type": "reset", "data": {"sample": SAMPLE}})["type"] == "observation"
        # json.dumps writes the lone surrogate as the escape \ud800: valid JSON, not Unicode text
        frame = exchange(ws, {"type": "step", "data": {"text": '<code>print("\ud800")</code>'}})
        assert frame == {"type": "error", "data": {
            "code": "VALIDATION_ERROR", "status": 422, "field": "data.text",
            "message": "step: the action text has a lone UTF-16 surrogate ('\\ud800') at character 13; "
                       "send valid Unicode"}}
        state = exchange(ws, {"type": "state"})["data"]
        assert (state["step_count"], state["done"]) == (0, False)  # the refused step did not count
        frame = exchange(ws, {"type": "step", "data": {"text": "<code>print(12 * 34)</code>"}})
        assert frame["data"]["observation"]["text"] == "\n<interpreter>\n408\n</interpreter>\n"
        frame = exchange(ws, {"type": "step", "data": {"text": "\\boxed{408}"}})
        assert (frame["data"]["reward"], frame["data"]["done"]) == (1.0, True)
    # over HTTP the same refusal names action.text
    r = httpx.post(f"{math_server.url}/reset", json={"sample": SAMPLE})
    sid = r.json()["metadata"]["session_id"]
    body = json.dumps({"session_id": sid, "action": {"text": "a\udfffb"}})  # ASCII: "\\udfff" escape
    r = httpx.post(f"{math_server.url}/step", content=body, headers={"content-type": "application/json"})
    assert (r.status_code, r.json()["code"], r.json()["field"]) == (422, "VALIDATION_ERROR", "action.text")
    assert httpx.delete(f"{math_server.url}/sessions/{sid}").json()["closed"] is True


def test_longest_action_outside_the_bmp_reaches_the_env(math_server):
    env = environments.make("remote", url=math_server.url, retries=0)
    try:
        n = env.action_space.max_length
        assert n == 65536
        env.reset(options={"sample": SAMPLE})
        # 65,536 characters, 786,470 bytes as the client's JSON message; the env ends the episode
        obs, reward, terminated, truncated, info = env.step("\U0001f600" * n)
        assert (obs, reward, terminated, truncated, info["invalid"]) == ("", 0.0, True, False, True)
        env.reset(options={"sample": SAMPLE})
        with pytest.raises(ValueError, match=r"action has 65537 characters, more than the remote env"):
            env.step("\U0001f600" * (n + 1))
    finally:
        env.close()
    # a longer one reaches the server too and is refused by name
    with connect(ws_url(math_server.url), max_size=None) as ws:
        exchange(ws, {"type": "reset", "data": {"sample": SAMPLE}})
        frame = exchange(ws, {"type": "step", "data": {"text": "\U0001f600" * (n + 1)}})
        assert (frame["data"]["code"], frame["data"]["status"], frame["data"]["field"]) == (
            "PAYLOAD_TOO_LARGE", 413, "data.text")


def test_client_gone_while_its_session_closes_is_not_an_asgi_error(tmp_path):
    (tmp_path / "slow_close_env.py").write_text(SLOW_CLOSE_ENV)
    log = tmp_path / "server.log"
    server = start_env_server(f"{tmp_path / 'slow_close_env.py'}:slowclose", log_path=log, cwd=tmp_path)
    try:
        for _ in range(3):
            with connect(ws_url(server.url)) as ws:
                frame = exchange(ws, {"type": "reset", "data": {"sample": {"id": "x"}}})
                assert frame["type"] == "observation"
                frame = exchange(ws, {"type": "step", "data": {"text": "anything"}})
                assert (frame["data"]["code"], frame["data"]["status"]) == ("EXECUTION_ERROR", 500)
            # the client is gone; the server closes the broken environment (1 s), then the socket
        deadline = time.monotonic() + 15
        while httpx.get(f"{server.url}/sessions").json()["active_sessions"] and time.monotonic() < deadline:
            time.sleep(0.1)
        stats = httpx.get(f"{server.url}/sessions").json()
        assert (stats["active_sessions"], stats["opened_total"]) == (0, 3)
        time.sleep(0.5)
    finally:
        server.stop()
    text = Path(log).read_text()
    assert text.count("step raised") == 3  # the environment's bug is logged, once per step
    assert "Exception in ASGI application" not in text and "WebSocketDisconnect" not in text


def test_a_refused_token_is_named_by_the_setting_in_use():
    from environments.remote.client import RemoteEnvConfig

    url = "http://127.0.0.1:1"
    assert RemoteEnvConfig(url, token="s3cret").token_field() == "RemoteEnvConfig.token=<hidden>"
    assert RemoteEnvConfig(url, token_file="/t").token_field() == "RemoteEnvConfig.token_file='/t'"
    assert RemoteEnvConfig(url).token_field() == "RemoteEnvConfig.token_file=None"


def test_serving_an_env_whose_mcp_server_dies_at_start_is_one_line_and_status_1(tmp_path):
    pytest.importorskip("mcp")
    (tmp_path / "crash.py").write_text("import sys\nsys.exit(3)\n")
    res = subprocess.run([sys.executable, "-m", "trainer.cli", "env", "serve", "--env", "mcp", "--port", "0",
                          f"command=[{sys.executable}, {tmp_path / 'crash.py'}]"], cwd=REPO,
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 1
    assert res.stderr.startswith("copc env serve: env 'mcp' could not be built (a service it needs failed): "
                                 "MCP server ") and "could not connect" in res.stderr
    assert "Traceback" not in res.stderr and len(res.stderr.strip().splitlines()) == 1
