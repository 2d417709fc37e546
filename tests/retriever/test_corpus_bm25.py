"""Corpus reader validation, BM25 scores against the Lucene formula, index metadata checks."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from retriever.bm25 import BM25Config, BM25Searcher
from retriever.corpus import CorpusFormatError, Passage, corpus_checksum, iter_corpus, load_corpus
from retriever.index import BuildConfig, build_index, load_index
from retriever.meta import IndexMeta, IndexMismatchError


def _write(path, lines):
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def test_reader_parses_title_and_text(tmp_path):
    p = _write(
        tmp_path / "c.jsonl",
        [
            json.dumps({"id": "a", "contents": '"Evan Morris"\nEvan Morris was a lobbyist.'}),
            "",
            json.dumps({"id": 7, "contents": "NoQuotes\nbody"}),
        ],
    )
    got = list(iter_corpus(p))
    assert [x.id for x in got] == ["a", "7"]
    assert got[0].title == "Evan Morris" and got[0].text == "Evan Morris was a lobbyist."
    assert got[1].title == "NoQuotes" and got[1].text == "body"


@pytest.mark.parametrize(
    ("bad", "needle"),
    [
        ('{"id": "x", "contents": ', "invalid JSON"),
        ('["not", "an", "object"]', "expected a JSON object"),
        ('{"contents": "t\\nx"}', "missing field 'id'"),
        ('{"id": "x"}', "missing field 'contents'"),
        ('{"id": "x", "contents": 5}', "field 'contents' must be a string"),
        ('{"id": "x", "contents": "   "}', "field 'contents' is empty"),
        ('{"id": null, "contents": "t"}', "field 'id' must be a string"),
        ('{"id": "0", "contents": "dup"}', "duplicate id '0'"),
    ],
)
def test_reader_reports_line_number(tmp_path, bad, needle):
    good = [json.dumps({"id": str(i), "contents": f'"T{i}"\ntext {i}'}) for i in range(2)]
    p = _write(tmp_path / "c.jsonl", [*good, bad])
    with pytest.raises(CorpusFormatError) as info:
        list(iter_corpus(p))
    assert info.value.line == 3
    assert f"c.jsonl:3: {needle}" in str(info.value)


def test_empty_corpus_and_missing_file(tmp_path):
    with pytest.raises(CorpusFormatError, match="no passages"):
        load_corpus(_write(tmp_path / "e.jsonl", [""]))
    with pytest.raises(FileNotFoundError, match=r"nope\.jsonl"):
        load_corpus(tmp_path / "nope.jsonl")


def test_checksum_is_sha256_of_bytes(tmp_path):
    import hashlib

    p = _write(tmp_path / "c.jsonl", [json.dumps({"id": "1", "contents": "x"})])
    assert corpus_checksum(p) == hashlib.sha256(p.read_bytes()).hexdigest()


def test_bm25_matches_lucene_formula_by_hand():
    # Tokens: d0 = cat cat dog (dl 3), d1 = dog bird (dl 2), d2 = fish (dl 1); avgdl = 2.
    s = BM25Searcher.build(
        ["cat cat dog", "dog bird", "fish"],
        BM25Config(stemmer="", stopwords=""),
        show_progress=False,
    )
    k1, b, n, avgdl = 0.9, 0.4, 3, 2.0

    def term(tf, df, dl):
        idf = math.log(1 + (n - df + 0.5) / (df + 0.5))
        return idf * tf / (tf + k1 * (1 - b + b * dl / avgdl))

    idx, scores = s.search(["cat", "dog bird"], 3)
    assert idx[0, 0] == 0 and scores[0, 0] == pytest.approx(term(2, 1, 3), rel=1e-6)
    assert scores[0, 0] == pytest.approx(0.6369021, rel=1e-6)  # hand-computed
    # "dog bird": d1 has both terms, d0 has dog only.
    assert idx[1].tolist()[:2] == [1, 0]
    assert scores[1, 0] == pytest.approx(term(1, 2, 2) + term(1, 1, 2), rel=1e-6)
    assert scores[1, 1] == pytest.approx(term(1, 2, 3), rel=1e-6)
    assert scores[1, 0] >= scores[1, 1]
    # d2 (fish) has no query term: not a hit, so its place is empty (row -1, score -inf).
    assert idx.tolist() == [[0, -1, -1], [1, 0, -1]]
    assert scores[0, 1:].tolist() == [-np.inf, -np.inf] and scores[1, 2] == -np.inf
    # k larger than the corpus is clamped.
    assert s.search(["cat"], 10)[0].tolist() == [[0, -1, -1]]


def test_bm25_config_validation():
    with pytest.raises(ValueError, match=r"bm25\.k1"):
        BM25Config(k1=0)
    with pytest.raises(ValueError, match=r"bm25\.b"):
        BM25Config(b=1.5)


def test_index_round_trip_and_other_corpus_refused(tmp_path):
    lines = [
        json.dumps({"id": str(i), "contents": f'"T{i}"\nalpha beta {w}'})
        for i, w in enumerate(["gamma", "delta", "epsilon", "zeta"])
    ]
    corpus = _write(tmp_path / "c.jsonl", lines)
    meta = build_index(
        BuildConfig(kind="bm25", corpus=str(corpus), out=str(tmp_path / "idx"), show_progress=False)
    )
    assert meta.num_passages == 4 and meta.corpus_sha256 == corpus_checksum(corpus)
    assert IndexMeta.load(tmp_path / "idx") == meta
    loaded = load_index(tmp_path / "idx")
    idx, _ = loaded.searcher.search(["delta"], 1)
    assert loaded.passages[idx[0, 0]] == Passage("1", '"T1"\nalpha beta delta')

    other = _write(tmp_path / "other.jsonl", [*lines, json.dumps({"id": "9", "contents": "x"})])
    with pytest.raises(IndexMismatchError, match="rebuild the index"):
        load_index(tmp_path / "idx", corpus=other)
    with pytest.raises(ValueError, match="not empty"):
        BuildConfig(kind="bm25", corpus=str(corpus), out=str(tmp_path / "idx"))
    with pytest.raises(FileNotFoundError, match="not a copc index"):
        load_index(tmp_path)


# Measured on this corpus: 0.660 (317/480). Floor leaves room for tokenizer/library drift.
BM25_RECALL5_FLOOR = 0.62


def test_bm25_recall_at_5_hotpotqa(shared_data, bm25_index):
    """Full 17,939-passage corpus, 480 non yes/no HotpotQA questions."""
    from retriever.quality import answer_recall, load_qa

    questions = load_qa(shared_data["hotpot"])
    assert len(questions) == 480
    loaded = load_index(bm25_index)
    idx, _ = loaded.searcher.search([q["question"] for q in questions], 5)
    hits = [[{"document": {"contents": loaded.passages[i].contents}} for i in row if i >= 0] for row in idx]
    recall = answer_recall(questions, hits)
    print(f"BM25 recall@5 = {recall:.3f}")
    assert recall >= BM25_RECALL5_FLOOR


def test_batched_scoring_equals_bm25s_retrieve(shared_data, bm25_index):
    """Reference: bm25s' own ``retrieve`` on the full corpus, 500 questions + edge cases."""
    from retriever.quality import load_qa

    s = load_index(bm25_index).searcher
    qs = [q["question"] for q in load_qa(shared_data["hotpot"], drop_yes_no=False)]
    qs += ["the of and", "Temple Temple Temple", "zzqx unknownword"]
    ids = s._tokenizer.tokenize(qs, update_vocab=False, return_as="ids", show_progress=False)
    ref_idx, ref_scores = s._retriever.retrieve(ids, k=10, show_progress=False, n_threads=1)
    idx, scores = s.search(qs, 10)
    # bm25s fills all 10 places, with score-0 passages (no query term) where fewer match;
    # we leave those places empty (row -1, score -inf) instead.
    hit = idx >= 0
    np.testing.assert_array_equal(hit, ref_scores > 0)
    assert not hit[-3].any() and not hit[-1].any() and hit[-2].all()  # no term / no term / a term
    np.testing.assert_allclose(scores[hit], ref_scores[hit], rtol=1e-5, atol=1e-5)
    assert np.all(scores[~hit] == -np.inf)
    # Each returned passage really has the reported score (bm25s' per-query scorer), so the
    # lists can differ from bm25s only by the order of (near-)tied passages.
    for j in range(len(qs)):
        full = s._retriever.get_scores_from_ids(ids[j])
        np.testing.assert_allclose(full[idx[j][hit[j]]], scores[j][hit[j]], rtol=1e-5, atol=1e-5)
    assert (idx[hit] == ref_idx[hit]).mean() > 0.98
    # Batch composition does not change a query's result.
    one_idx, _ = s.search(qs[3:4], 10)
    np.testing.assert_array_equal(one_idx[0], idx[3])
