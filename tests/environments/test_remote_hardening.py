"""``copc env serve`` against a hostile web page and hostile bodies (issue 21, item 7), on a real
server on 127.0.0.1:

* without a token, a request whose ``Origin`` is not loopback (a web page of another site
  opening ``ws://127.0.0.1:PORT/ws``: cross-site WebSocket hijacking) or whose ``Host`` is not a
  loopback name (DNS rebinding) is refused with 403 naming the header, over HTTP and on the
  WebSocket handshake, and so is a loopback origin other than the server's own (a page of another
  local server, issue 44); the server's own origin and clients sending neither header are served;
  with a token the token decides;
* a body or message that is valid JSON but holds a value Python will not build (a 5,000-digit
  integer) is a 400 ``INVALID_JSON`` naming ``body`` / ``message``, not a 500;
* ``GET /state`` and the ``/ws`` ``state`` message count as session activity (idle timeout).
"""

from __future__ import annotations

import json
import socket
import time

import httpx
import pytest
from websockets.exceptions import InvalidStatus
from websockets.sync.client import connect

from environments.remote.launch import start_env_server

SAMPLE = {"id": "m1", "problem": "What is 12 * 34?", "answer": "408"}
IDLE_S = 2.0
HUGE = "1" * 5000  # valid JSON number; int("1" * 5000) exceeds Python's 4,300-digit limit


@pytest.fixture(scope="module")
def server():
    """math_tool, no token, a 2 s idle timeout."""
    srv = start_env_server("math_tool", extra_args=("--idle-timeout", str(IDLE_S), "--sandbox-workers", "1"))
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def token_server(tmp_path_factory):
    token_file = tmp_path_factory.mktemp("tok") / "token"
    token_file.write_text("s3cret\n")
    srv = start_env_server("math_tool",
                           extra_args=("--token-file", str(token_file), "--sandbox-workers", "1"))
    yield srv
    srv.stop()


def ws_url(url: str) -> str:
    return url.replace("http://", "ws://") + "/ws"


def exchange(ws, message) -> dict:
    ws.send(message if isinstance(message, str) else json.dumps(message))
    return json.loads(ws.recv(timeout=60))


def test_foreign_origin_and_host_are_refused_without_a_token(server):
    url, port = server.url, server.url.rsplit(":", 1)[1]
    for headers, field in [({"Origin": "http://evil.example"}, "Origin"),
                           ({"Origin": "null"}, "Origin"),
                           ({"Origin": "http://127.0.0.1.evil.example"}, "Origin"),
                           # a page of another local server (issue 44): loopback, but not this server
                           ({"Origin": "http://localhost:3000"}, "Origin"),
                           ({"Origin": "https://[::1]"}, "Origin"),
                           ({"Origin": f"http://127.0.0.1:{int(port) + 1}"}, "Origin"),
                           ({"Host": f"evil.example:{port}"}, "Host"),
                           ({"Host": "rebind.attacker.test"}, "Host")]:
        for r in (httpx.get(f"{url}/schema", headers=headers),
                  httpx.get(f"{url}/health", headers=headers),
                  httpx.post(f"{url}/reset", json={"sample": SAMPLE}, headers=headers)):
            assert r.status_code == 403, (headers, r.text)
            body = r.json()
            assert (body["code"], body["field"]) == ("FORBIDDEN", field), headers
            assert repr(headers[field]) in body["detail"]
        with pytest.raises(InvalidStatus) as e:
            if field == "Host":  # the handshake addressed to another name, sent to 127.0.0.1
                sock = socket.create_connection(("127.0.0.1", int(port)))
                connect(f"ws://{headers['Host']}/ws", sock=sock, open_timeout=30)
            else:
                connect(ws_url(url), origin=headers["Origin"], open_timeout=30)
        assert e.value.response.status_code == 403
        assert json.loads(e.value.response.body)["field"] == field
    assert httpx.get(f"{url}/sessions").json()["opened_total"] == 0  # nothing was opened
    # the server's own origin, loopback hosts, and clients that send no Origin, are served
    for headers in [{}, {"Origin": f"http://127.0.0.1:{port}"}, {"Host": f"localhost:{port}"},
                    {"Host": "127.0.0.1"}, {"Host": f"localhost:{port}", "Origin": f"http://localhost:{port}"}]:
        assert httpx.get(f"{url}/schema", headers=headers).status_code == 200, headers
    with connect(ws_url(url), origin=f"http://127.0.0.1:{port}") as ws:
        frame = exchange(ws, {"type": "reset", "data": {"sample": SAMPLE}})
        assert frame["type"] == "observation" and "12 * 34" in frame["data"]["observation"]["text"]


def test_with_a_token_the_token_decides(token_server):
    url = token_server.url
    evil = {"Origin": "http://evil.example"}
    r = httpx.get(f"{url}/schema", headers=evil)
    assert (r.status_code, r.json()["field"]) == (401, "Authorization")
    r = httpx.get(f"{url}/schema", headers={**evil, "Authorization": "Bearer s3cret"})
    assert r.status_code == 200 and "action" in r.json()


def test_unparsable_json_values_are_400_not_500(server):
    url = server.url
    for body in [f'{{"sample": {{"id": "x", "problem": "p", "answer": {HUGE}}}}}', f'{{"seed": {HUGE}}}',
                 f"[{HUGE}]"]:
        r = httpx.post(f"{url}/reset", content=body, headers={"content-type": "application/json"})
        assert r.status_code == 400, r.text
        assert (r.json()["code"], r.json()["field"]) == ("INVALID_JSON", "body")
        assert r.json()["detail"].startswith("request body holds a value the server cannot parse (Exceeds "
                                             "the limit (4300 digits) for integer string conversion")
    sid = httpx.post(f"{url}/reset", json={"sample": SAMPLE}).json()["metadata"]["session_id"]
    r = httpx.post(f"{url}/step", content=f'{{"session_id": "{sid}", "action": {{"text": {HUGE}}}}}')
    assert (r.status_code, r.json()["code"], r.json()["field"]) == (400, "INVALID_JSON", "body")
    with connect(ws_url(url)) as ws:
        frame = exchange(ws, f'{{"type": "reset", "data": {{"seed": {HUGE}}}}}')
        assert frame["type"] == "error"
        assert {k: frame["data"][k] for k in ("code", "status", "field")} == {
            "code": "INVALID_JSON", "status": 400, "field": "message"}
        assert "4300 digits" in frame["data"]["message"]
        # the session goes on
        assert exchange(ws, {"type": "reset", "data": {"sample": SAMPLE}})["type"] == "observation"
        frame = exchange(ws, {"type": "step", "data": {"text": "<code>print(12 * 34)</code>"}})
        assert frame["data"]["observation"]["text"] == "\n<interpreter>\n408\n</interpreter>\n"
    assert httpx.delete(f"{url}/sessions/{sid}").json()["closed"] is True


def test_a_lone_surrogate_in_a_reset_sample_is_422_and_opens_no_session(server):
    """Valid JSON (``\\ud800``) that is no Unicode text: was a 500 whose opened session leaked
    (three of them and every client got 503 until the idle timeout)."""
    url = server.url
    before = httpx.get(f"{url}/sessions").json()["opened_total"]
    bad = '{"sample": {"id": "x", "problem": "\\ud800", "answer": "1"}}'
    for _ in range(4):
        r = httpx.post(f"{url}/reset", content=bad, headers={"content-type": "application/json"})
        assert (r.status_code, r.json()["code"], r.json()["field"]) == (422, "VALIDATION_ERROR",
                                                                        "sample.problem"), r.text
    assert httpx.get(f"{url}/sessions").json()["opened_total"] == before
    with connect(ws_url(url)) as ws:
        frame = exchange(ws, '{"type": "reset", "data": {"sample": {"id": "x", "problem": "ok", '
                             '"tags": ["\\udfff"]}}}')
        assert (frame["type"], frame["data"]["status"], frame["data"]["field"]) == (
            "error", 422, "data.sample.tags[0]")
        assert exchange(ws, {"type": "reset", "data": {"sample": SAMPLE}})["type"] == "observation"


def test_state_requests_keep_a_session_alive(server):
    url = server.url
    sid = httpx.post(f"{url}/reset", json={"sample": SAMPLE}).json()["metadata"]["session_id"]
    with connect(ws_url(url)) as ws:
        assert exchange(ws, {"type": "reset", "data": {"sample": SAMPLE}})["type"] == "observation"
        t0 = time.monotonic()
        while time.monotonic() - t0 < 2.5 * IDLE_S:  # only state requests, for longer than the timeout
            r = httpx.get(f"{url}/state", params={"session_id": sid})
            assert r.status_code == 200, r.text
            frame = exchange(ws, {"type": "state"})
            assert frame["type"] == "state" and frame["data"]["step_count"] == 0
            time.sleep(IDLE_S / 4)
        # both sessions are still open and step
        frame = exchange(ws, {"type": "step", "data": {"text": "\\boxed{408}"}})
        assert (frame["data"]["reward"], frame["data"]["done"]) == (1.0, True)
    r = httpx.post(f"{url}/step", json={"session_id": sid, "action": {"text": "\\boxed{408}"}})
    assert r.status_code == 200 and r.json()["reward"] == 1.0
    # and without any request a session still expires
    sid = httpx.post(f"{url}/reset", json={"sample": SAMPLE}).json()["metadata"]["session_id"]
    time.sleep(IDLE_S + 1.5)
    assert httpx.get(f"{url}/state", params={"session_id": sid}).status_code == 404
