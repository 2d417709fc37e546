"""A real BM25 retriever server on 127.0.0.1 (random free port) over the shared Wikipedia corpus,
for the warm-start and evaluation tests (import the ``retriever_url`` fixture)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SHARED = Path(os.environ.get("COPC_SHARED", REPO.parent / "shared"))
CORPUS = SHARED / "data" / "wiki" / "corpus.jsonl"
QA_DIR = SHARED / "data"


@pytest.fixture(scope="module")
def retriever_url(tmp_path_factory) -> Iterator[str]:
    """Base URL of ``retriever.cli serve`` on a BM25 index of the full shared corpus (the index
    is built once per session, under pytest's base temp dir; meta.json is written last)."""
    if not CORPUS.is_file() or not (QA_DIR / "qa" / "nq.jsonl").is_file():
        pytest.skip(f"shared data not found under {SHARED} (set COPC_SHARED)")
    from retriever.launch import ensure_bm25_index, start_server

    index = ensure_bm25_index(CORPUS, tmp_path_factory.getbasetemp() / "trainer_bm25_index")
    server = start_server(index)
    try:
        yield server.url
    finally:
        server.stop()
