"""Fixtures for retriever tests: data paths, indexes built once per session, and
real servers (``python -m retriever.cli serve``) on 127.0.0.1 at a random free port."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from retriever.launch import free_port, start_server, wait_healthy
from retriever.quality import load_qa

__all__ = ["free_port", "start_process", "stop_process"]

REPO = Path(__file__).resolve().parents[2]
DATA = REPO / "data"
CORPUS = DATA / "wiki" / "corpus.jsonl"
HOTPOT = DATA / "qa" / "hotpotqa.jsonl"

# Dense tests use a corpus subset: supporting passages of the first N_DENSE_QUESTIONS
# (non yes/no) HotpotQA questions plus every DISTRACTOR_STRIDE-th passage as distractors.
N_DENSE_QUESTIONS = 40
DISTRACTOR_STRIDE = 50


def start_process(args: list[str], port: int) -> tuple[subprocess.Popen, str]:
    """Start ``python <args>`` with output captured; returns the process and base URL."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1"}
    proc = subprocess.Popen(
        [sys.executable, *args],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    url = f"http://127.0.0.1:{port}"
    wait_healthy(url, proc)
    return proc, url


def stop_process(proc: subprocess.Popen) -> None:
    """Terminate a server started by :func:`start_process` (kill after 10 s)."""
    proc.terminate()
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def serve_index(index_dir: Path, *extra: str) -> Iterator[str]:
    """Run ``retriever.cli serve`` on ``index_dir``; yields the base URL."""
    server = start_server(index_dir, extra_args=extra)
    try:
        yield server.url
    finally:
        server.stop()


@pytest.fixture(scope="session")
def shared_data() -> dict[str, Path]:
    """Paths of the repository's corpus and QA set (skips if the data is absent)."""
    if not CORPUS.is_file() or not HOTPOT.is_file():
        pytest.skip(f"data not found under {DATA}")
    return {"corpus": CORPUS, "hotpot": HOTPOT}


@pytest.fixture(scope="session")
def bm25_index(shared_data, tmp_path_factory) -> Path:
    """BM25 index of the full 17,939-passage corpus (about 5 s to build)."""
    from retriever.index import BuildConfig, build_index

    out = tmp_path_factory.mktemp("bm25") / "index"
    build_index(
        BuildConfig(kind="bm25", corpus=str(shared_data["corpus"]), out=str(out), show_progress=False)
    )
    return out


@pytest.fixture(scope="session")
def bm25_server(bm25_index) -> Iterator[str]:
    """Base URL of a real server on the full-corpus BM25 index (max_topk 20)."""
    yield from serve_index(bm25_index, "--max-topk", "20", "--max-queries", "64", "--max-query-chars", "500")


@pytest.fixture(scope="session")
def dense_subset(shared_data, tmp_path_factory) -> dict:
    """Corpus subset for dense tests: supporting passages of the first questions plus
    regularly spaced distractors; written as JSONL. Returns ``{"corpus", "questions"}``."""
    from retriever.corpus import load_corpus

    questions = load_qa(shared_data["hotpot"])[:N_DENSE_QUESTIONS]
    titles = {t for q in questions for t in q["supporting_titles"]}
    passages = load_corpus(shared_data["corpus"])
    keep = [p for i, p in enumerate(passages) if p.title in titles or i % DISTRACTOR_STRIDE == 0]
    path = tmp_path_factory.mktemp("dense_corpus") / "subset.jsonl"
    with path.open("w", encoding="utf-8") as fh:
        for p in keep:
            fh.write(json.dumps({"id": p.id, "contents": p.contents}, ensure_ascii=False) + "\n")
    return {"corpus": path, "questions": questions, "num_passages": len(keep)}


@pytest.fixture(scope="session")
def dense_index(dense_subset, tmp_path_factory) -> Path:
    """Flat-IP MiniLM index of the dense subset (the slow part: CPU encoding)."""
    from retriever.encoder import EncoderConfig
    from retriever.index import BuildConfig, build_index

    out = tmp_path_factory.mktemp("dense") / "index"
    build_index(
        BuildConfig(
            kind="dense",
            corpus=str(dense_subset["corpus"]),
            out=str(out),
            encoder=EncoderConfig(device="cpu"),
            show_progress=False,
        )
    )
    return out


@pytest.fixture(scope="session")
def dense_server(dense_index) -> Iterator[str]:
    """Base URL of a real server on the dense subset index."""
    yield from serve_index(dense_index, "--device", "cpu")
