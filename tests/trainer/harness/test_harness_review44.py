"""Issue 44 item 6 (fresh review) of the harness endpoint, on a real endpoint on 127.0.0.1 with a
raw socket: a request whose head is complete but whose body trickles in (one byte every 0.3 s)
is answered ``408`` once ``header_timeout_s`` has passed. Before, the handler waited for the body
with no limit: a key holder held the connection and its handler task indefinitely, also after its
episode had finished (measured: still held 8 s after ``finish``, header timeout 1 s)."""

from __future__ import annotations

import socket
import time

import httpx

from .test_harness_limits import Served


def test_a_trickled_body_is_answered_408_after_the_header_timeout():
    """Head with a valid key and ``Content-Length: 1000``, then a byte every 0.3 s: 408 (naming
    ``header_timeout_s``) within about 1 s, and a well-formed request is still served."""
    srv = Served(header_timeout_s=1.0)
    try:
        with socket.create_connection(("127.0.0.1", srv.port), timeout=10) as s:
            s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer "
                      + srv.key.encode() + b"\r\nContent-Length: 1000\r\n\r\n")
            t0, answer = time.perf_counter(), b""
            s.settimeout(0.3)
            while time.perf_counter() - t0 < 6 and b"\r\n\r\n" not in answer:
                try:
                    s.sendall(b" ")
                    answer += s.recv(65536)
                except TimeoutError:
                    continue
                except (BrokenPipeError, ConnectionResetError):
                    break
            waited = time.perf_counter() - t0
        assert answer.startswith(b"HTTP/1.1 408"), (answer[:200], waited)
        assert waited < 3.0, waited
        r = httpx.post(srv.server.base_url + "/chat/completions", content=b"{" * 100,
                       headers={"Authorization": f"Bearer {srv.key}"})
        assert r.status_code == 400 and "not JSON" in r.text
    finally:
        srv.close()
