"""A real BM25 retriever server on 127.0.0.1 (random free port) over the repository's Wikipedia corpus,
for the warm-start and evaluation tests (import the ``retriever_url`` fixture)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
QA_DIR = REPO / "data"
CORPUS = QA_DIR / "wiki" / "corpus.jsonl"


@pytest.fixture(scope="module")
def retriever_url(tmp_path_factory) -> Iterator[str]:
    """Base URL of ``retriever.cli serve`` on a BM25 index of the full corpus (the index
    is built once per session, under pytest's base temp dir; meta.json is written last)."""
    if not CORPUS.is_file() or not (QA_DIR / "qa" / "nq.jsonl").is_file():
        pytest.skip(f"data not found under {QA_DIR}")
    from retriever.launch import ensure_bm25_index, start_server

    index = ensure_bm25_index(CORPUS, tmp_path_factory.getbasetemp() / "trainer_bm25_index")
    server = start_server(index)
    try:
        yield server.url
    finally:
        server.stop()
