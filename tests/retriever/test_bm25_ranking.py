"""BM25 ranking rules: ties by lower row (top-k a prefix of top-(k+1)), and no hits for
passages without a query term (issue 9, faults 5 and 6). Unit tests on the selection
functions, then the real full-corpus index, the real server and the real client."""

from __future__ import annotations

import asyncio
import json
import re

import httpx
import numpy as np
import pytest

from retriever.bm25 import drop_unmatched, top_k_columns, top_k_rows
from retriever.client import AsyncRetrieverClient, RetrieverClient
from retriever.index import load_index

N_CORPUS = 17939
NO_TERM_QUERIES = ["the of and a to", "zzqxv flurbnik", "?!? ..."]  # stop words / unknown / punctuation


def _full_scores(searcher, query: str) -> np.ndarray:
    """bm25s' own score of every passage for ``query`` (float32 ``(N,)``), the reference."""
    ids = searcher._tokenizer.tokenize([query], update_vocab=False, return_as="ids", show_progress=False)
    return searcher._retriever.get_scores_from_ids(ids[0])


def _reference(v: np.ndarray, k: int) -> list[int]:
    """Slow reference: full sort by (-score, row), first k."""
    return sorted(range(len(v)), key=lambda r: (-float(v[r]), r))[:k]


# --- selection functions ---------------------------------------------------------------


def test_issue_example_one_high_row_rest_tied():
    v = np.ones(N_CORPUS, dtype=np.float32)
    v[5] = 2.0
    assert top_k_rows(v, 3).tolist() == [5, 0, 1]
    idx, val = top_k_columns(v[:, None], 3)
    assert idx.tolist() == [[5, 0, 1]] and val.tolist() == [[2.0, 1.0, 1.0]]
    # Same with the tie block at the end of the vector and the best row last.
    w = np.zeros(N_CORPUS, dtype=np.float32)
    w[100:] = 0.5
    w[-1] = 3.0
    assert top_k_rows(w, 4).tolist() == [N_CORPUS - 1, 100, 101, 102]


def test_hand_built_small_vectors():
    v = np.array([0.0, 2.0, 1.0, 2.0, 1.0, -1.0, 2.0], dtype=np.float32)
    assert top_k_rows(v, 7).tolist() == [1, 3, 6, 2, 4, 0, 5]
    assert top_k_rows(v, 2).tolist() == [1, 3]
    assert top_k_rows(v, 4).tolist() == [1, 3, 6, 2]
    assert top_k_rows(v, 0).tolist() == []
    assert top_k_rows(v, 99).tolist() == [1, 3, 6, 2, 4, 0, 5]  # clamped
    inf = np.array([-np.inf, 1.0, np.inf, -np.inf, 1.0], dtype=np.float32)
    assert top_k_rows(inf, 5).tolist() == [2, 1, 4, 0, 3]


@pytest.mark.parametrize("levels", [2, 3, 7, 1000])
def test_random_ties_match_slow_sort_and_prefix_property(levels):
    rng = np.random.default_rng(levels)
    for trial in range(60):
        n = int(rng.integers(1, 200))
        v = (rng.integers(0, levels, n) / 4).astype(np.float32)  # many exact ties
        ranked = [top_k_rows(v, k).tolist() for k in range(n + 2)]
        for k in range(n + 2):
            assert ranked[k] == _reference(v, k), (trial, k)
            if k < n:
                assert ranked[k + 1][:k] == ranked[k]  # top-k is a prefix of top-(k+1)


def test_columns_independent_of_batch_and_equal_to_reference():
    rng = np.random.default_rng(7)
    scores = rng.integers(0, 4, size=(500, 9)).astype(np.float32)
    idx, val = top_k_columns(scores, 25)
    assert idx.shape == (9, 25) and val.dtype == np.float32
    for j in range(9):
        assert idx[j].tolist() == _reference(scores[:, j], 25)
        np.testing.assert_array_equal(val[j], scores[idx[j], j])
        one_idx, _ = top_k_columns(scores[:, j : j + 1], 25)  # the query alone in its batch
        np.testing.assert_array_equal(one_idx[0], idx[j])


def test_columns_reject_nan_and_bad_shape():
    bad = np.ones((4, 2), dtype=np.float32)
    bad[1, 1] = np.nan
    with pytest.raises(ValueError, match="NaN"):
        top_k_columns(bad, 2)
    with pytest.raises(ValueError, match="2-D"):
        top_k_columns(np.ones(4, dtype=np.float32), 2)


def test_drop_unmatched_marks_zero_scores():
    idx = np.array([[4, 2, 0], [1, 3, 5]], dtype=np.int64)
    val = np.array([[3.5, 0.0, 0.0], [0.0, 0.0, 0.0]], dtype=np.float32)
    out_idx, out_val = drop_unmatched(idx, val)
    assert out_idx.tolist() == [[4, -1, -1], [-1, -1, -1]]
    assert out_val.tolist() == [[3.5, -np.inf, -np.inf], [-np.inf] * 3]
    assert out_idx.dtype == np.int64 and out_val.dtype == np.float32


# --- the real full-corpus index ----------------------------------------------------------


@pytest.fixture(scope="module")
def searcher(bm25_index):
    return load_index(bm25_index).searcher


@pytest.fixture(scope="module")
def cocteau_rows(shared_data) -> list[int]:
    """Corpus rows mentioning "Cocteau", found by a plain text scan (not by BM25). Also
    checks that passage ids are the row numbers, which the server tests rely on."""
    with shared_data["corpus"].open(encoding="utf-8") as fh:
        recs = [json.loads(line) for line in fh]
    assert all(r["id"] == str(i) for i, r in enumerate(recs))
    rows = [i for i, r in enumerate(recs) if re.search(r"\bcocteau", r["contents"].lower())]
    assert rows == [18, 6084]  # "Eileen Herlie", "Beauty and the Beast (1946 film)"
    return rows


def test_real_index_ties_lower_row_first(searcher):
    """Single-term queries: every passage's score is one stored value (no summation-order
    noise), so the expected list is the slow sort of bm25s' own per-passage scores. ``k``
    is also set inside runs of tied scores, where the k-th place must go to the lowest
    tied row."""
    words = ["film", "born", "river", "album", "station", "american", "football"]
    cut_ties = 0
    for w in words:
        full = _full_scores(searcher, w)
        assert len(full) == N_CORPUS
        ref = _reference(full, 100)
        ref_scores = full[ref]
        # k = 20, plus every k <= 99 whose k-th score is tied with the (k+1)-th.
        ks = [20, *(k for k in range(1, 100) if ref_scores[k - 1] == ref_scores[k])]
        cut_ties += len(ks) - 1
        for k in ks:
            idx, scores = searcher.search([w], k)
            assert idx[0].tolist() == ref[:k], (w, k)
            np.testing.assert_array_equal(scores[0], ref_scores[:k])
    assert cut_ties >= 10  # the check above really cut through tied scores


def test_real_index_prefix_property(searcher, shared_data):
    from retriever.quality import load_qa

    qs = [q["question"] for q in load_qa(shared_data["hotpot"])[:20]] + ["film", "Temple Temple"]
    full, _ = searcher.search(qs, 20)
    for k in range(1, 20):
        idx, _ = searcher.search(qs, k)
        np.testing.assert_array_equal(idx, full[:, :k])
    # Multi-term queries: same order as the slow sort of the batch's own score vectors.
    q_ids = searcher._tokenizer.tokenize(qs, update_vocab=False, return_as="ids", show_progress=False)
    mat = searcher._batch_scores(q_ids)
    for j in range(len(qs)):
        assert full[j].tolist() == _reference(mat[:, j], 20)


def test_real_index_no_term_means_no_hit(searcher, cocteau_rows):
    idx, scores = searcher.search([*NO_TERM_QUERIES, "Cocteau", "the Cocteau ?!"], 3)
    for j in range(3):
        assert idx[j].tolist() == [-1, -1, -1] and np.all(scores[j] == -np.inf)
    for j in (3, 4):  # "Cocteau" occurs in exactly two passages
        assert sorted(idx[j, :2].tolist()) == cocteau_rows and idx[j, 2] == -1
        assert np.all(scores[j, :2] > 0) and scores[j, 2] == -np.inf
    full = _full_scores(searcher, "Cocteau")
    assert np.flatnonzero(full > 0).tolist() == cocteau_rows  # bm25s agrees: only these score
    np.testing.assert_array_equal(scores[3, :2], full[idx[3, :2]])


# --- the real server and client ----------------------------------------------------------


def test_server_returns_short_and_empty_lists(bm25_server, cocteau_rows):
    qs = [*NO_TERM_QUERIES, "Cocteau", "Shirley Temple"]
    for with_scores in (True, False):
        body = {"queries": qs, "topk": 3, "return_scores": with_scores}
        r = httpx.post(f"{bm25_server}/retrieve", json=body, timeout=30)
        assert r.status_code == 200
        res = r.json()["result"]
        assert [len(x) for x in res] == [0, 0, 0, 2, 3]
        assert sorted(int(h["document"]["id"]) for h in res[3]) == cocteau_rows
        keys = {"document", "score"} if with_scores else {"document"}
        assert all(set(h) == keys for row in res for h in row)
        if with_scores:
            assert all(h["score"] > 0 for row in res for h in row)


def test_server_tie_order_matches_reference(bm25_server, searcher, cocteau_rows):
    """Through HTTP, with ``topk`` cutting a run of tied scores (server max_topk is 20)."""
    checked = 0
    for w in ["film", "born", "river", "album", "station", "american", "football"]:
        full = _full_scores(searcher, w)
        ref = _reference(full, 21)
        for k in (k for k in range(1, 21) if full[ref[k - 1]] == full[ref[k]]):
            body = {"queries": [w], "topk": k, "return_scores": True}
            res = httpx.post(f"{bm25_server}/retrieve", json=body, timeout=30).json()["result"][0]
            assert [int(h["document"]["id"]) for h in res] == ref[:k], (w, k)
            checked += 1
    assert checked >= 3


def test_clients_handle_empty_lists(bm25_server, cocteau_rows):
    with RetrieverClient(url=bm25_server) as client:
        got = client.retrieve([NO_TERM_QUERIES[0], "Cocteau"], topk=5)
        assert got[0] == [] and len(got[1]) == 2
        assert client.search("zzqxv flurbnik") == []

    async def run():
        async with AsyncRetrieverClient(url=bm25_server) as aclient:
            return await aclient.retrieve(["?!? ...", "Cocteau"], topk=5)

    got = asyncio.run(run())
    assert got[0] == [] and sorted(int(h["document"]["id"]) for h in got[1]) == cocteau_rows
