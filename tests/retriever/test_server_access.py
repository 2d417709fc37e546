"""``copc retriever serve`` limits and access control (issue 21, item 8), on real servers on
127.0.0.1: a request-body limit (413 beyond it; default: the longest valid request plus 64 KiB),
the same access rule as ``copc env serve`` (:mod:`retriever.access`): a non-loopback ``--host``
needs ``--token-file`` (exit 2), a token is enforced, and without one a foreign ``Origin`` /
``Host`` is refused."""

from __future__ import annotations

import json
import subprocess
import sys

import httpx
import pytest

from retriever.client import ClientConfig, RetrieverClient, RetrieverRequestError
from retriever.launch import REPO, start_server

from .conftest import serve_index


@pytest.fixture(scope="module")
def small_limit_server(bm25_index):
    yield from serve_index(bm25_index, "--max-queries", "64", "--max-query-chars", "500")


def padded(n: int) -> bytes:
    """A valid ``/retrieve`` body of exactly ``n`` bytes (JSON padded with spaces)."""
    core = b'{"queries": ["Shirley Temple"], "topk": 1}'
    return core + b" " * (n - len(core))


def test_body_limit_default_and_413(small_limit_server):
    url = small_limit_server
    limit = 12 * 64 * 500 + 65536  # 12 bytes per query character x max_queries x max_query_chars + 64 KiB
    assert httpx.get(f"{url}/health").json()["max_request_bytes"] == limit == 449_536
    ok = httpx.post(f"{url}/retrieve", content=padded(limit), timeout=30)
    assert ok.status_code == 200 and len(ok.json()["result"][0]) == 1
    r = httpx.post(f"{url}/retrieve", content=padded(limit + 1), timeout=30)
    assert r.status_code == 413
    assert r.json()["message"] == f"request body larger than {limit} bytes (--max-request-bytes)"
    # the same without a Content-Length (chunked): counted while reading, refused at the limit

    def chunks():
        for _ in range(100):
            yield b" " * 65536

    r = httpx.post(f"{url}/retrieve", content=chunks(), timeout=30)
    assert r.status_code == 413 and "larger than 449536 bytes" in r.json()["message"]
    assert httpx.get(f"{url}/health").status_code == 200


def test_explicit_body_limit_and_unparsable_values(bm25_index):
    server = start_server(bm25_index, extra_args=("--max-request-bytes", "1000"))
    try:
        assert httpx.post(f"{server.url}/retrieve", content=padded(1000)).status_code == 200
        r = httpx.post(f"{server.url}/retrieve", content=padded(1001))
        assert (r.status_code, r.json()["message"]) == (
            413, "request body larger than 1000 bytes (--max-request-bytes)")
        r = httpx.post(f"{server.url}/retrieve", content=b'{"queries": ["a"], "topk": ' + b"1" * 600 + b"}")
        assert r.status_code == 422 and r.json()["message"].startswith("topk: "), r.text
    finally:
        server.stop()


def _serve(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "trainer.cli", "retriever", "serve", *args], cwd=REPO,
                          capture_output=True, text=True, timeout=120)


def test_non_loopback_host_needs_a_token(tmp_path, bm25_index):
    r = _serve("--index", str(bm25_index), "--host", "0.0.0.0", "--port", "0")
    assert r.returncode == 2, r.stderr
    assert ("--host='0.0.0.0': binding a non-loopback address requires a bearer token (--token-file FILE)"
            in r.stderr)
    assert r.stderr.count("\n") == 1  # one line, no traceback
    empty = tmp_path / "empty"
    empty.write_text(" \n")
    r = _serve("--index", str(bm25_index), "--host", "0.0.0.0", "--token-file", str(empty))
    assert r.returncode == 2 and "--token-file=" in r.stderr and "the token file is empty" in r.stderr


def test_token_is_enforced_and_the_client_sends_it(tmp_path, bm25_index):
    token_file = tmp_path / "token"
    token_file.write_text("r3triever\n")
    server = start_server(bm25_index, extra_args=("--token-file", str(token_file)))
    body = {"queries": ["Shirley Temple"], "topk": 1}
    try:
        assert httpx.get(f"{server.url}/health").status_code == 200  # liveness stays open
        r = httpx.post(f"{server.url}/retrieve", json=body)
        assert (r.status_code, r.json()["code"], r.json()["field"]) == (401, "UNAUTHORIZED", "Authorization")
        r = httpx.post(f"{server.url}/retrieve", json=body, headers={"Authorization": "Bearer nope"})
        assert (r.status_code, r.json()["detail"]) == (403, "wrong bearer token")
        r = httpx.post(f"{server.url}/retrieve", json=body, headers={"Authorization": "Bearer r3triever",
                                                                     "Origin": "http://evil.example"})
        assert r.status_code == 200 and len(r.json()["result"][0]) == 1
        client = RetrieverClient(ClientConfig(url=server.url, token="r3triever"))
        assert len(client.search("Shirley Temple", topk=2)) == 2
        client.close()
        client = RetrieverClient(ClientConfig(url=server.url, max_retries=0))
        with pytest.raises(RetrieverRequestError, match=r"HTTP 401"):
            client.search("Shirley Temple")
        client.close()
    finally:
        server.stop()


def test_foreign_origin_or_host_refused_without_a_token(small_limit_server):
    url, port = small_limit_server, small_limit_server.rsplit(":", 1)[1]
    body = {"queries": ["Shirley Temple"], "topk": 1}
    for headers, field in [({"Origin": "http://evil.example"}, "Origin"), ({"Origin": "null"}, "Origin"),
                           ({"Host": f"evil.example:{port}"}, "Host")]:
        r = httpx.post(f"{url}/retrieve", json=body, headers=headers)
        assert r.status_code == 403 and json.loads(r.content)["field"] == field, headers
    for headers in [{}, {"Origin": f"http://127.0.0.1:{port}"}, {"Host": f"localhost:{port}"}]:
        assert httpx.post(f"{url}/retrieve", json=body, headers=headers).status_code == 200, headers
