"""Fixtures for the environments tests: one real bwrap sandbox pool per test session."""

from __future__ import annotations

import os

import pytest

from environments.sandbox import Sandbox, SandboxConfig

SECRET = "copc-test-secret-4f1e9a"


@pytest.fixture(scope="session")
def sandbox():
    """A 2-worker bwrap pool started while the host holds a secret environment variable."""
    os.environ["COPC_TEST_SECRET"] = SECRET
    try:
        sb = Sandbox(SandboxConfig(workers=2, timeout_s=5.0, memory_mb=512,
                                   max_output_bytes=8192, max_processes=16))
    finally:
        del os.environ["COPC_TEST_SECRET"]
    yield sb
    sb.close()


@pytest.fixture(scope="session")
def retriever_url(tmp_path_factory):
    """A real retriever server (``python -m retriever.cli serve``, BM25 on the repository's
    17,939-passage corpus) on 127.0.0.1 at a random free port."""
    from pathlib import Path

    from retriever.launch import ensure_bm25_index, start_server

    corpus = Path(__file__).resolve().parents[2] / "data/wiki/corpus.jsonl"
    index = ensure_bm25_index(corpus, tmp_path_factory.mktemp("env-bm25") / "index")
    server = start_server(index)
    yield server.url
    server.stop()
