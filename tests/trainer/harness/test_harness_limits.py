"""The harness endpoint against a hostile local client (issue 44, item 5), on a real endpoint on
127.0.0.1 with a real engine and real HTTP clients:

* a call still in flight when its agent returns gets 410 and changes nothing: the trajectory the
  episode returned (reward on its last model token) is what is trained;
* a body over ``max_body_bytes`` is refused with 413 before it is read (from its
  ``Content-Length``; a chunked one as soon as it passes the limit);
* a connection that does not send its request head in ``header_timeout_s`` is closed, and beyond
  ``max_waiting_connections`` connections waiting for their head a new one is closed at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time

import httpx
import pytest
from scripted import scripted

from trainer.engines.base import SamplingParams
from trainer.engines.embedded import EmbeddedEngine
from trainer.harness.env import HarnessEnv
from trainer.harness.server import HarnessServer
from trainer.rollout.agent_loop import AgentLoopConfig

from . import test_harness as th

pytestmark = pytest.mark.usefixtures("one_torch_thread")
chat_model_tok = th.chat_model_tok  # the fixture, shared


def test_a_call_in_flight_when_the_agent_returns_changes_nothing(chat_model_tok):
    """The agent's second call reaches the endpoint, waits for the (paused) engine, and the agent
    returns meanwhile: once the engine resumes, that call is answered 410 and the returned
    trajectory is unchanged."""
    model, tok = chat_model_tok

    async def main():
        eng = EmbeddedEngine(model, tok, logits_processor=scripted(tok, th.ACTIONS, th.turn_of))
        client = httpx.AsyncClient(timeout=120)
        late: dict = {}

        async def agent(base_url, api_key, row):
            url, auth = base_url + "/chat/completions", {"Authorization": "Bearer " + api_key}
            msgs = [{"role": "user", "content": row["problem"]}]
            r = await client.post(url, json={"model": "m", "messages": msgs}, headers=auth)
            assert r.status_code == 200, r.text
            msgs += [r.json()["choices"][0]["message"], {"role": "user", "content": "go on"}]
            await eng.pause()  # the next call waits for the engine
            late["call"] = asyncio.create_task(client.post(url, json={"model": "m", "messages": msgs},
                                                           headers=auth))
            await asyncio.sleep(1.0)  # it has reached the endpoint and waits inside the episode
            return 1.0

        env = HarnessEnv(agent=th.AGENT)
        env.agent = agent
        tr = await env.play_episode(eng, tok, th.ROW, SamplingParams(max_new_tokens=120), AgentLoopConfig())
        returned = (list(tr.response_ids), list(tr.loss_mask), tr.token_rewards(), tr.finish_reason)
        assert not late["call"].done()
        await eng.resume()
        answer = await late["call"]
        after = (list(tr.response_ids), list(tr.loss_mask), tr.token_rewards(), tr.finish_reason)
        await client.aclose()
        env.close()
        await eng.close()
        return tr, returned, after, answer

    tr, returned, after, answer = asyncio.run(main())
    assert returned[3] == "terminated" and tr.info["harness_calls"] == 1
    assert answer.status_code == 410 and answer.json()["error"]["type"] == "episode_finished", answer.text
    assert after == returned  # nothing appended after the agent returned
    last_model = max(i for i, m in enumerate(tr.loss_mask) if m)
    assert tr.token_rewards() == {last_model: 1.0} and last_model == len(tr.loss_mask) - 1


class Served:
    """A :class:`HarnessServer` on its own event loop in a thread, serving one open key."""

    def __init__(self, **limits) -> None:
        import threading

        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, daemon=True).start()
        self.server = HarnessServer(**limits)
        asyncio.run_coroutine_threadsafe(self.server.start(), self.loop).result(60)
        self.key = self.server.open(object())  # never reached: every request here is refused first
        self.port = int(self.server.base_url.split(":")[2].split("/")[0])

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.server.close)
        time.sleep(0.3)
        self.loop.call_soon_threadsafe(self.loop.stop)


def raw(port: int, head: bytes, body: bytes = b"", timeout: float = 10.0) -> bytes:
    """Send ``head`` (and ``body``) on a new connection; what the server answers until it closes
    or ``timeout`` passes."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        out = b""
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):  # refused while still sending
            s.sendall(head + body)
        try:
            while chunk := s.recv(65536):
                out += chunk
                if b"\r\n\r\n" in out and b'"error"' in out:
                    break
        except TimeoutError:
            pass
        return out


def test_a_body_over_the_limit_is_refused_before_it_is_read():
    srv = Served(max_body_bytes=1 << 20)
    try:
        auth = f"Authorization: Bearer {srv.key}\r\n".encode()
        # 300 MB announced, none of it sent: the answer comes from the head alone
        t0 = time.perf_counter()
        got = raw(srv.port, b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n" + auth +
                  b"Content-Type: application/json\r\nContent-Length: 300000000\r\n\r\n", timeout=10)
        assert got.startswith(b"HTTP/1.1 413"), got[:200]
        assert b"max_body_bytes=1048576" in got and time.perf_counter() - t0 < 5
        # chunked, no length: refused once past the limit
        chunk = b"x" * 65536
        body = b"".join(b"%x\r\n" % len(chunk) + chunk + b"\r\n" for _ in range(17))
        got = raw(srv.port, b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n" + auth +
                  b"Transfer-Encoding: chunked\r\n\r\n", body)
        assert got.startswith(b"HTTP/1.1 413"), got[:200]
        # under the limit the body is read (and found not to be JSON)
        r = httpx.post(srv.server.base_url + "/chat/completions", content=b"{" * 1000,
                       headers={"Authorization": f"Bearer {srv.key}"})
        assert r.status_code == 400 and "not JSON" in r.text
    finally:
        srv.close()
    with pytest.raises(ValueError, match=r"HarnessServer\.max_body_bytes=0: must be an int >= 1"):
        HarnessServer(max_body_bytes=0)


def test_connections_that_never_finish_their_head_are_closed_and_capped():
    srv = Served(header_timeout_s=1.0, max_waiting_connections=50)
    socks = []
    try:
        for i in range(60):  # 50 waiting connections, then 10 more
            s = socket.create_connection(("127.0.0.1", srv.port), timeout=10)
            s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: " + b"a" * i)
            socks.append(s)
        time.sleep(0.3)

        def closed(s: socket.socket, wait: float) -> bool:
            s.settimeout(wait)
            try:
                return s.recv(1) == b""
            except ConnectionResetError:
                return True
            except TimeoutError:
                return False

        assert sum(closed(s, 0.05) for s in socks[50:]) == 10  # over the cap: closed at once
        assert sum(closed(s, 0.01) for s in socks[:50]) == 0  # the first 50 still open
        time.sleep(1.5)
        assert sum(closed(s, 0.5) for s in socks[:50]) == 50  # header timeout
        assert len(srv.server._server.config.http_protocol_class.waiting) == 0
        # a well-behaved client is served meanwhile and afterwards, on one kept-alive connection
        with httpx.Client() as c:
            for _ in range(3):
                r = c.post(srv.server.base_url + "/chat/completions", json={"messages": []},
                           headers={"Authorization": "Bearer copc-wrong"})
                assert r.status_code == 401
    finally:
        for s in socks:
            s.close()
        srv.close()
    with pytest.raises(ValueError, match=r"header_timeout_s=0: must be a number of seconds > 0"):
        HarnessServer(header_timeout_s=0)


def test_the_limits_are_the_harness_tasks_settings(tmp_path):
    """``task.settings`` of ``task.env: harness`` sets the endpoint's limits (a run's 413 then names
    the configured size); a bad value is one line naming the key."""
    import json

    from trainer.config import ConfigError, load_config
    from trainer.config.specs import task_spec
    from trainer.tasks.harness import HarnessTask

    rows = tmp_path / "rows.jsonl"
    rows.write_text(json.dumps(th.ROW) + "\n")
    base = ["task.env=harness", f"task.train_data=[{rows}]", f"task.env_kwargs.agent={th.AGENT}"]
    cfg = load_config(None, [*base, "task.settings={max_body_bytes: 4096, header_timeout_s: 2.5, "
                                    "max_waiting_connections: 7}"])
    task = HarnessTask(task_spec(cfg), "harness")
    task.start_services()
    try:
        assert task._server.max_body_bytes == 4096 and task._server._limits == (2.5, 7)
    finally:
        task.close()
    default = HarnessTask(task_spec(load_config(None, base)), "harness")
    default.start_services()
    try:
        assert default._server.max_body_bytes == 16 << 20 and default._server._limits == (10.0, 1024)
    finally:
        default.close()
    for bad, msg in [("max_body_bytes: 0", r"task\.settings\.max_body_bytes=0: must be an int >= 1"),
                     ("header_timeout_s: -1",
                      r"task\.settings\.header_timeout_s=-1\.0: must be > 0 \(seconds\)$"),
                     ("max_waiting_connections: true",
                      r"task\.settings\.max_waiting_connections=True: must be an int")]:
        with pytest.raises(ConfigError, match=rf"^{msg}"):
            HarnessTask(task_spec(load_config(None, [*base, f"task.settings={{{bad}}}"])), "harness")
