"""RetrieverClient against real servers: batching, 4xx, retries with backoff, timeouts."""

from __future__ import annotations

import ssl
import time
from pathlib import Path

import httpx
import pytest

from retriever.client import (
    ClientConfig,
    RetrieverClient,
    RetrieverRequestError,
    RetrieverUnavailableError,
    _needs_tls,
)

from .conftest import free_port, start_process, stop_process

FLAKY = str(Path(__file__).with_name("flaky_server.py"))


@pytest.fixture
def flaky(request):
    """Start flaky_server.py with (fails, hangs) from the test's parametrisation."""
    fails, hangs = request.param
    port = free_port()
    proc, url = start_process([FLAKY, str(port), str(fails), str(hangs)], port)
    yield url
    stop_process(proc)


def test_backoff_schedule():
    cfg = ClientConfig(backoff_s=0.5, backoff_max_s=3.0)
    assert [cfg.backoff(i) for i in range(5)] == [0.5, 1.0, 2.0, 3.0, 3.0]
    with pytest.raises(ValueError, match=r"client\.url"):
        ClientConfig(url="localhost:8000")


def test_client_batches_and_preserves_order(bm25_server):
    qs = ["Shirley Temple", "Animorphs", "Kiss and Tell", "Evan Morris", "Aladin"]
    before = httpx.get(f"{bm25_server}/health").json()
    with RetrieverClient(url=bm25_server, batch_size=2) as client:
        res = client.retrieve(qs, topk=2)
        assert client.attempts == 3  # ceil(5 / 2) requests
        one = client.search("Animorphs", topk=2)
    after = httpx.get(f"{bm25_server}/health").json()
    assert after["queries"] - before["queries"] == 6
    # "Aladin" occurs in one passage only (row 13016, by a text scan): one hit, not two.
    assert [len(r) for r in res] == [2, 2, 2, 2, 1] and res[1] == one
    assert res[4][0]["document"]["id"] == "13016"
    assert res[0][0]["document"]["contents"].startswith('"Shirley Temple"')


def test_client_4xx_not_retried(bm25_server):
    with RetrieverClient(url=bm25_server, max_retries=3, backoff_s=1.0) as client:
        t0 = time.monotonic()
        with pytest.raises(RetrieverRequestError, match=r"HTTP 422.*topk") as info:
            client.retrieve(["x"], topk=1000)
        assert client.attempts == 1 and time.monotonic() - t0 < 1.0
    assert info.value.status == 422


@pytest.mark.parametrize("flaky", [(2, 0)], indirect=True)
def test_client_retries_5xx_then_succeeds(flaky):
    with RetrieverClient(url=flaky, max_retries=3, backoff_s=0.2) as client:
        t0 = time.monotonic()
        res = client.retrieve(["hello", "world"], topk=1)
        elapsed = time.monotonic() - t0
        assert client.attempts == 3
    assert [r[0]["document"]["contents"] for r in res] == ["hello", "world"]
    assert elapsed >= 0.2 + 0.4  # two backoffs: 0.2 s then 0.4 s
    assert httpx.get(f"{flaky}/stats").json()["calls"] == 3


@pytest.mark.parametrize("flaky", [(5, 0)], indirect=True)
def test_client_gives_clear_error_after_last_retry(flaky):
    with (
        RetrieverClient(url=flaky, max_retries=2, backoff_s=0.05) as client,
        pytest.raises(RetrieverUnavailableError) as info,
    ):
        client.retrieve(["q"])
    msg = str(info.value)
    assert "failed after 3 attempts" in msg and "HTTP 503" in msg and "flaky failure 3" in msg
    assert httpx.get(f"{flaky}/stats").json()["calls"] == 3


@pytest.mark.parametrize("flaky", [(0, 1)], indirect=True)
def test_client_retries_timeouts(flaky):
    with RetrieverClient(url=flaky, max_retries=1, backoff_s=0.0, timeout_s=1.0) as client:
        res = client.retrieve(["late"])
        assert client.attempts == 2
    assert res[0][0]["document"]["contents"] == "late"


def test_client_connection_refused_after_backoff():
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    with RetrieverClient(url=url, max_retries=2, backoff_s=0.1, timeout_s=2.0) as client:
        t0 = time.monotonic()
        with pytest.raises(RetrieverUnavailableError, match=r"failed after 3 attempts.*Connect"):
            client.retrieve(["q"])
        assert time.monotonic() - t0 >= 0.1 + 0.2
        assert client.attempts == 3


@pytest.mark.parametrize("flaky", [(1, 0)], indirect=True)
def test_async_client_retries_and_matches_sync(flaky, bm25_server):
    import asyncio

    from retriever.client import AsyncRetrieverClient

    async def run():
        async with AsyncRetrieverClient(url=flaky, max_retries=2, backoff_s=0.05) as c:
            res = await c.retrieve(["a", "b", "c"], topk=1)
            assert c.attempts == 2  # one 503, then success
        async with AsyncRetrieverClient(url=bm25_server, batch_size=2) as c:
            many = await asyncio.gather(
                *(c.retrieve(["Animorphs", "Shirley Temple"], topk=2) for _ in range(16))
            )
            with pytest.raises(RetrieverRequestError, match=r"queries\.0"):
                await c.retrieve([""])
        return res, many

    res, many = asyncio.run(run())
    assert [r[0]["document"]["contents"] for r in res] == ["a", "b", "c"]
    with RetrieverClient(url=bm25_server) as sync:
        expected = sync.retrieve(["Animorphs", "Shirley Temple"], topk=2)
    assert all(m == expected for m in many)


@pytest.mark.parametrize("url,tls", [("http://127.0.0.1:8000", False), ("https://search.example.org", True)])
def test_only_https_clients_build_a_verifying_tls_context(url, tls):
    assert _needs_tls(url) is tls
    # and the clients get it: an https client's transport verifies certificates, an http one skips
    # building the (costly) verifying context
    with RetrieverClient(url=url) as c:
        ctx = c._http._transport._pool._ssl_context
        assert (ctx.verify_mode == ssl.CERT_REQUIRED) is tls
