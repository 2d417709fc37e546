"""Real BM25 server on 127.0.0.1: Search-R1 API shapes, validation errors, concurrency."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from retriever.client import RetrieverClient


def _post(url, body, **kw):
    return httpx.post(f"{url}/retrieve", json=body, timeout=30, **kw)


def test_health(bm25_server):
    h = httpx.get(f"{bm25_server}/health").json()
    assert h["status"] == "ok" and h["kind"] == "bm25" and h["num_passages"] == 17939
    assert len(h["corpus_sha256"]) == 64


def test_search_r1_shape_with_scores(bm25_server):
    r = _post(
        bm25_server,
        {
            "queries": ["Shirley Temple Chief of Protocol", "Animorphs"],
            "topk": 4,
            "return_scores": True,
        },
    )
    assert r.status_code == 200
    body = r.json()
    assert list(body) == ["result"] and len(body["result"]) == 2
    # "Animorphs" occurs in three passages only (rows 4581, 13005, 13011, by a text scan):
    # three hits, not a fourth passage without any query term.
    assert [len(row) for row in body["result"]] == [4, 3]
    assert sorted(int(h["document"]["id"]) for h in body["result"][1]) == [4581, 13005, 13011]
    for row in body["result"]:
        for hit in row:
            assert set(hit) == {"document", "score"}
            assert set(hit["document"]) == {"id", "contents"}
            assert isinstance(hit["score"], float)
        scores = [h["score"] for h in row]
        assert scores == sorted(scores, reverse=True) and scores[0] > 0
    assert body["result"][0][0]["document"]["contents"].startswith('"Shirley Temple"\n')
    assert body["result"][1][0]["document"]["contents"].startswith('"Animorphs"\n')


def test_shape_without_scores_and_defaults(bm25_server):
    q = {"queries": ["Kiss and Tell 1945 film"], "topk": 5}
    with_s = _post(bm25_server, {**q, "return_scores": True}).json()["result"][0]
    without = _post(bm25_server, {**q, "return_scores": False}).json()["result"][0]
    assert all(set(h) == {"document"} for h in without)
    assert [h["document"] for h in without] == [h["document"] for h in with_s]
    # topk omitted -> default 3; return_scores omitted -> false (Search-R1 defaults).
    default = _post(bm25_server, {"queries": ["Kiss and Tell 1945 film"]}).json()["result"][0]
    assert [h["document"] for h in default] == [h["document"] for h in with_s[:3]]


@pytest.mark.parametrize("k", [1, 7, 20])
def test_topk_respected_and_batch_consistent(bm25_server, k):
    qs = ["Shirley Temple", "science fantasy young adult series", "Aladin stage name"]
    batched = _post(bm25_server, {"queries": qs, "topk": k, "return_scores": True}).json()
    assert [len(r) for r in batched["result"]] == [k, k, k]
    single = _post(bm25_server, {"queries": qs[1:2], "topk": k, "return_scores": True}).json()
    assert single["result"][0] == batched["result"][1]


BAD_REQUESTS = [
    ({"topk": 3}, "queries", "Field required"),
    ({"queries": []}, "queries", "at least 1 item"),
    ({"queries": "Shirley Temple"}, "queries", "valid array"),
    ({"queries": ["ok", ""]}, "queries.1", "empty"),
    ({"queries": ["   "]}, "queries.0", "empty"),
    ({"queries": ["ok", 5]}, "queries.1", "valid string"),
    ({"queries": [None]}, "queries.0", "valid string"),
    ({"queries": ["x"], "topk": 0}, "topk", "greater than 0"),
    ({"queries": ["x"], "topk": -2}, "topk", "greater than 0"),
    ({"queries": ["x"], "topk": 21}, "topk", "less than or equal to 20"),
    ({"queries": ["x"], "topk": "3"}, "topk", "valid integer"),
    ({"queries": ["x"], "return_scores": "yes"}, "return_scores", "valid boolean"),
    ({"queries": ["q"] * 65}, "queries", "at most 64 items"),
    ({"queries": ["a" * 501]}, "queries.0", "at most 500 characters"),
]


@pytest.mark.parametrize(("body", "field", "msg"), BAD_REQUESTS)
def test_bad_request_is_4xx_naming_field(bm25_server, body, field, msg):
    r = _post(bm25_server, body)
    assert r.status_code == 422, r.text
    message = r.json()["message"]
    assert message.startswith(f"{field}: ") and msg in message, message
    # The server keeps serving.
    ok = _post(bm25_server, {"queries": ["Shirley Temple"], "topk": 1})
    assert ok.status_code == 200 and len(ok.json()["result"][0]) == 1


def test_malformed_json_is_4xx(bm25_server):
    r = httpx.post(f"{bm25_server}/retrieve", content=b'{"queries": ["a"', timeout=10)
    assert r.status_code == 422 and "Invalid JSON" in r.json()["message"]
    r = httpx.post(f"{bm25_server}/retrieve", content=b"[1, 2]", timeout=10)
    assert r.status_code == 422
    assert httpx.get(f"{bm25_server}/health").status_code == 200


def test_curl_style_form_content_type_accepted(bm25_server):
    r = httpx.post(
        f"{bm25_server}/retrieve",
        content=b'{"queries": ["Animorphs"], "topk": 1}',
        headers={"content-type": "application/x-www-form-urlencoded"},
        timeout=10,
    )
    assert r.status_code == 200 and len(r.json()["result"][0]) == 1


def test_32_concurrent_clients_50_requests_each(bm25_server):
    queries = ["Shirley Temple", "Animorphs companion books", "Kiss and Tell", "Evan Morris"]
    before = httpx.get(f"{bm25_server}/health").json()
    expected = {
        q: _post(bm25_server, {"queries": [q], "topk": 3, "return_scores": True}).json()["result"][0]
        for q in queries
    }

    def worker(w: int) -> int:
        errors = 0
        with RetrieverClient(url=bm25_server, max_retries=0, timeout_s=30) as client:
            for i in range(50):
                q = queries[(w + i) % len(queries)]
                try:
                    got = client.retrieve([q], topk=3)[0]
                    errors += got != expected[q]
                except Exception:
                    errors += 1
        return errors

    with ThreadPoolExecutor(32) as pool:
        errors = sum(pool.map(worker, range(32)))
    assert errors == 0
    after = httpx.get(f"{bm25_server}/health").json()
    n_queries = after["queries"] - before["queries"]
    n_batches = after["batches"] - before["batches"]
    assert n_queries == 32 * 50 + len(queries)
    # Concurrent requests were merged: fewer backend calls than requests.
    assert n_batches < n_queries
