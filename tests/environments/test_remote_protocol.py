"""``copc env serve`` speaks OpenEnv: OpenEnv's own client plays a full ReTool episode with the
real sandbox and sees exactly what the in-process environment gives; bad requests (HTTP and
WebSocket) get 4xx naming the field and the server keeps serving; the bearer token is enforced
on HTTP and WebSocket; a non-loopback bind without a token is refused (exit 2)."""

from __future__ import annotations

import json
import subprocess
import sys

import httpx
import pytest
from websockets.exceptions import ConnectionClosed, InvalidStatus
from websockets.sync.client import connect

import environments
from environments.remote.launch import REPO, start_env_server

SAMPLE = {"id": "m1", "problem": "What is 12 * 34?", "answer": "408"}
#: A ReTool episode: a fenced code call, a bare-expression call, a failing call, the answer.
RETOOL_TURNS = [
    "Let me compute.\n<code>\n```python\nx = 12 * 34\nprint(x)\n```\n</code>",
    "<code>\nimport math\nmath.factorial(5)\n</code>",
    "<code>\n1/0\n</code>",
    "So the product is \\boxed{408}.",
]
MAX_ACTION = 65536  # MathToolEnv's action_space.max_length (EnvLimits.max_action_chars)


@pytest.fixture(scope="module")
def math_server():
    server = start_env_server("math_tool")
    yield server
    server.stop()


@pytest.fixture(scope="module")
def token_server(tmp_path_factory):
    token_file = tmp_path_factory.mktemp("tok") / "token"
    token_file.write_text("s3cret-token\n")
    server = start_env_server("math_tool", extra_args=("--token-file", str(token_file)))
    yield server, token_file
    server.stop()


def local_episode(turns: list[str]) -> list[tuple]:
    """(obs, reward, terminated, truncated, info) of the in-process env, reset first."""
    env = environments.make("math_tool")
    try:
        obs, info = env.reset(options={"sample": SAMPLE})
        out = [(obs, None, False, False, info)]
        for turn in turns:
            out.append(env.step(turn))
        return out
    finally:
        env.close()


def test_openenv_client_full_retool_episode_matches_in_process(math_server):
    from openenv.core.generic_client import GenericEnvClient

    expected = local_episode(RETOOL_TURNS)
    got = []
    with GenericEnvClient(base_url=math_server.url).sync() as client:
        r = client.reset(sample=SAMPLE)
        got.append((r.observation["text"], r.reward, r.observation["terminated"], r.observation["truncated"],
                    r.observation["info"]))
        assert r.done is False and len(r.observation["metadata"]["session_id"]) == 32
        for turn in RETOOL_TURNS:
            r = client.step({"text": turn})
            got.append((r.observation["text"], r.reward, r.observation["terminated"],
                        r.observation["truncated"], r.observation["info"]))
            assert r.done == (r.observation["terminated"] or r.observation["truncated"])
        state = client.state()
    assert got == expected
    # the episode as the tools computed it: 408, 5! = 120, the error, then the scored answer
    replies = ["408", "120", "ZeroDivisionError: division by zero"]
    assert [g[0] for g in got[1:]] == [f"\n<interpreter>\n{r}\n</interpreter>\n" for r in replies] + [""]
    assert got[-1][1:4] == (1.0, True, False) and got[-1][4]["tool_calls"] == 3
    assert state["step_count"] == 4 and state["done"] is True and state["env_id"] == "math_tool"
    assert httpx.get(f"{math_server.url}/sessions").json()["active_sessions"] == 0


def test_schema_publishes_limits_and_stop_strings(math_server):
    schema = httpx.get(f"{math_server.url}/schema").json()
    action = schema["action"]
    assert action["x-copc-stop-strings"] == ["</code>"] and action["x-copc-env"] == "math_tool"
    assert action["properties"]["text"]["maxLength"] == MAX_ACTION and action["required"] == ["text"]
    assert schema["observation"]["properties"]["text"]["maxLength"] == 1 << 20
    assert httpx.get(f"{math_server.url}/metadata").json()["name"] == "math_tool"


def _expect(r: httpx.Response, status: int, code: str, field: str) -> dict:
    assert r.status_code == status, r.text
    body = r.json()
    assert (body["code"], body["field"]) == (code, field), body
    return body


def test_bad_http_requests_get_4xx_naming_the_field(math_server):
    url = math_server.url
    _expect(httpx.post(f"{url}/reset", content=b"{not json"), 400, "INVALID_JSON", "body")
    _expect(httpx.post(f"{url}/reset", json=[1, 2]), 422, "VALIDATION_ERROR", "body")
    b = _expect(httpx.post(f"{url}/reset", json={"sample": "x"}), 422, "VALIDATION_ERROR", "sample")
    assert "JSON object" in b["detail"]
    b = _expect(httpx.post(f"{url}/reset", json={"sample": {"id": "q", "answer": "1"}}), 422,
                "VALIDATION_ERROR", "sample")
    assert "no 'problem' field" in b["detail"]
    _expect(httpx.post(f"{url}/reset", json={"seed": -1}), 422, "VALIDATION_ERROR", "seed")
    _expect(httpx.post(f"{url}/reset", json={"sampel": {}}), 422, "VALIDATION_ERROR", "sampel")
    _expect(httpx.post(f"{url}/step", json={"action": {"text": "hi"}}), 422, "VALIDATION_ERROR", "session_id")
    b = _expect(httpx.post(f"{url}/step", json={"session_id": "nope", "action": {"text": "hi"}}), 404,
                "UNKNOWN_SESSION", "session_id")
    assert "'nope'" in b["detail"]
    # an HTTP session: reset, bad actions, the answer, then a step after the end
    r = httpx.post(f"{url}/reset", json={"sample": SAMPLE})
    sid = r.json()["metadata"]["session_id"]
    _expect(httpx.post(f"{url}/step", json={"session_id": sid, "action": {"txt": "x"}}), 422,
            "VALIDATION_ERROR", "action.text")
    long_action = {"text": "x" * (MAX_ACTION + 1)}
    b = _expect(httpx.post(f"{url}/step", json={"session_id": sid, "action": long_action}),
                413, "PAYLOAD_TOO_LARGE", "action.text")
    assert f"{MAX_ACTION + 1} characters" in b["detail"]
    r = httpx.post(f"{url}/step", json={"session_id": sid, "action": {"text": "\\boxed{408}"}})
    assert r.status_code == 200 and r.json()["reward"] == 1.0 and r.json()["done"] is True
    b = _expect(httpx.post(f"{url}/step", json={"session_id": sid, "action": {"text": "more"}}), 409,
                "EPISODE_OVER", "action.text")
    assert "episode is over" in b["detail"]
    assert httpx.get(f"{url}/state", params={"session_id": sid}).json()["done"] is True
    _expect(httpx.get(f"{url}/state"), 422, "VALIDATION_ERROR", "session_id")
    # a body over the request limit (12 bytes per action character + 64 KiB by default)
    _expect(httpx.post(f"{url}/step", content=b"x" * (12 * MAX_ACTION + 65537)), 413, "PAYLOAD_TOO_LARGE",
            "body")
    assert httpx.delete(f"{url}/sessions/{sid}").json() == {"session_id": sid, "closed": True}
    _expect(httpx.delete(f"{url}/sessions/{sid}"), 404, "UNKNOWN_SESSION", "session_id")
    # still serving: a fresh episode works
    r = httpx.post(f"{url}/reset", json={"sample": SAMPLE})
    sid = r.json()["metadata"]["session_id"]
    r = httpx.post(f"{url}/step", json={"session_id": sid, "action": {"text": "<code>print(6*7)</code>"}})
    assert r.json()["observation"]["text"] == "\n<interpreter>\n42\n</interpreter>\n"
    httpx.delete(f"{url}/sessions/{sid}")
    assert httpx.get(f"{url}/sessions").json()["active_sessions"] == 0


def _error(ws) -> dict:
    frame = json.loads(ws.recv(timeout=30))
    assert frame["type"] == "error", frame
    return frame["data"]


def test_bad_websocket_messages_get_error_frames_and_the_session_goes_on(math_server):
    ws_url = math_server.url.replace("http", "ws") + "/ws"
    with connect(ws_url) as ws:
        ws.send("{oops")
        assert _error(ws) | {"message": ""} == {"message": "", "code": "INVALID_JSON", "status": 400,
                                                "field": "message"}
        ws.send(json.dumps({"type": "step", "data": {"text": "hi"}}))  # before any reset
        e = _error(ws)
        assert (e["code"], e["status"], e["field"]) == ("EPISODE_OVER", 409, "data.text")
        ws.send(json.dumps({"type": "reset", "data": {"sample": SAMPLE, "bogus": 1}}))
        e = _error(ws)
        assert (e["status"], e["field"]) == (422, "data.bogus")
        ws.send(json.dumps({"type": "reset", "data": {"sample": SAMPLE}}))
        frame = json.loads(ws.recv(timeout=30))
        assert frame["type"] == "observation" and "12 * 34" in frame["data"]["observation"]["text"]
        ws.send(json.dumps({"type": "step", "data": {"text": "x" * (MAX_ACTION + 1)}}))
        e = _error(ws)
        assert (e["code"], e["status"], e["field"]) == ("PAYLOAD_TOO_LARGE", 413, "data.text")
        ws.send(json.dumps({"type": "step", "data": {"message": "x"}}))
        assert _error(ws)["field"] == "data.text"
        ws.send(json.dumps({"type": "step", "data": {"text": "\\boxed{408}"}}))
        frame = json.loads(ws.recv(timeout=30))
        assert frame["data"]["reward"] == 1.0 and frame["data"]["done"] is True
        ws.send(json.dumps({"type": "step", "data": {"text": "again"}}))
        assert _error(ws)["status"] == 409
    with connect(ws_url) as ws:
        ws.send(json.dumps({"type": "jump"}))
        e = _error(ws)
        assert (e["code"], e["status"], e["field"]) == ("UNKNOWN_TYPE", 400, "type")
    with connect(ws_url + "?session_id=deadbeef") as ws:
        e = _error(ws)
        assert (e["code"], e["status"], e["field"]) == ("UNKNOWN_SESSION", 404, "session_id")
        with pytest.raises(ConnectionClosed):
            ws.recv(timeout=10)
        assert ws.close_code == 4404
    assert httpx.get(f"{math_server.url}/health").json() == {"status": "healthy"}
    assert httpx.get(f"{math_server.url}/sessions").json()["active_sessions"] == 0


def test_websocket_attaches_to_an_http_session(math_server):
    r = httpx.post(f"{math_server.url}/reset", json={"sample": SAMPLE})
    sid = r.json()["metadata"]["session_id"]
    with connect(math_server.url.replace("http", "ws") + f"/ws?session_id={sid}") as ws:
        ws.send(json.dumps({"type": "step", "data": {"text": "<code>print(2**10)</code>"}}))
        reply = json.loads(ws.recv(timeout=30))["data"]["observation"]["text"]
        assert reply == "\n<interpreter>\n1024\n</interpreter>\n"
    # the attached session outlives the connection (its owner is the HTTP client)
    assert httpx.get(f"{math_server.url}/state", params={"session_id": sid}).json()["step_count"] == 1
    assert httpx.delete(f"{math_server.url}/sessions/{sid}").status_code == 200


def test_token_is_required_on_http_and_websocket(token_server):
    server, token_file = token_server
    url = server.url
    assert httpx.get(f"{url}/health").status_code == 200  # the liveness probe stays open
    b = _expect(httpx.get(f"{url}/schema"), 401, "UNAUTHORIZED", "Authorization")
    assert "Bearer" in b["detail"]
    _expect(httpx.get(f"{url}/schema", headers={"Authorization": "Basic abc"}), 401, "UNAUTHORIZED",
            "Authorization")
    wrong = {"Authorization": "Bearer wrong"}
    b = _expect(httpx.post(f"{url}/reset", json={"sample": SAMPLE}, headers=wrong), 403, "FORBIDDEN",
                "Authorization")
    assert b["detail"] == "wrong bearer token"
    ok = {"Authorization": "Bearer s3cret-token"}
    assert httpx.get(f"{url}/schema", headers=ok).status_code == 200
    ws_url = url.replace("http", "ws") + "/ws"
    for headers, status in (({}, 401), ({"Authorization": "Bearer wrong"}, 403)):
        with pytest.raises(InvalidStatus) as e:
            connect(ws_url, additional_headers=headers)
        assert e.value.response.status_code == status
        assert json.loads(e.value.response.body)["field"] == "Authorization"
    from openenv.core.generic_client import GenericEnvClient

    with GenericEnvClient(base_url=url, headers=ok).sync() as client:
        assert "12 * 34" in client.reset(sample=SAMPLE).observation["text"]
    env = environments.make("remote", url=url, token_file=str(token_file))
    assert "12 * 34" in env.reset(options={"sample": SAMPLE})[0]
    env.close()
    bad = token_file.parent / "bad"
    bad.write_text("nope")
    with pytest.raises(ValueError, match=r"RemoteEnvConfig.token_file=.*HTTP 403: wrong bearer token"):
        environments.make("remote", url=url, token_file=str(bad))
    assert httpx.get(f"{url}/sessions", headers=ok).json()["active_sessions"] == 0


def _serve(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "trainer.cli", "env", "serve", *args], cwd=REPO,
                          capture_output=True, text=True, timeout=120)


def test_non_loopback_bind_without_token_is_refused(tmp_path):
    r = _serve("--env", "math_tool", "--host", "0.0.0.0", "--port", "0")
    assert r.returncode == 2
    assert "--host='0.0.0.0': binding a non-loopback address requires a bearer token (--token-file FILE)" \
        in r.stderr
    empty = tmp_path / "empty"
    empty.write_text("  \n")
    r = _serve("--env", "math_tool", "--host", "0.0.0.0", "--token-file", str(empty), "--max-sessions", "0")
    assert r.returncode == 2 and "the token file is empty" in r.stderr
    r = _serve("--env", "no_such_env")
    assert r.returncode == 2 and "--env='no_such_env'" in r.stderr and "math_tool" in r.stderr
    r = _serve("--env", "math_tool", "--max-sessions", "0", "--idle-timeout", "5")
    assert r.returncode == 2 and "--max-sessions=0: must be an int >= 1" in r.stderr
    r = _serve("--env", "math_tool", "limits.max_turns=0")
    assert r.returncode == 2 and "EnvLimits.max_turns=0" in r.stderr
