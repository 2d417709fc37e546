"""A real BM25 retriever server on 127.0.0.1 (random free port) over the shared Wikipedia corpus,
for the warm-start and evaluation tests (import the ``retriever_url`` fixture)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

REPO = Path(__file__).resolve().parents[2]
SHARED = Path(os.environ.get("COPC_SHARED", REPO.parent / "shared"))
CORPUS = SHARED / "data" / "wiki" / "corpus.jsonl"
QA_DIR = SHARED / "data"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def retriever_url(tmp_path_factory) -> Iterator[str]:
    """Base URL of ``retriever.cli serve`` on a BM25 index of the full shared corpus (the index
    is built once per session, under pytest's base temp dir; meta.json is written last)."""
    if not CORPUS.is_file() or not (QA_DIR / "qa" / "nq.jsonl").is_file():
        pytest.skip(f"shared data not found under {SHARED} (set COPC_SHARED)")
    from retriever.index import BuildConfig, build_index

    index = tmp_path_factory.getbasetemp() / "trainer_bm25_index"
    if not (index / "meta.json").is_file():
        build_index(BuildConfig(kind="bm25", corpus=str(CORPUS), out=str(index), show_progress=False))
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "retriever.cli", "serve", "--index", str(index),
                             "--port", str(port)], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1"})
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"retriever server exited with {proc.returncode}:\n{proc.stdout.read()}")
            try:
                if httpx.get(f"{url}/health", timeout=1.0).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"retriever server at {url} not healthy after 120 s")
            time.sleep(0.1)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
