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
    """A real retriever server (``python -m retriever.cli serve``, BM25 on the shared
    17,939-passage corpus) on 127.0.0.1 at a random free port."""
    import socket
    import subprocess
    import sys
    import time
    from pathlib import Path

    import httpx

    from retriever.index import BuildConfig, build_index

    corpus = Path(__file__).resolve().parents[2].parent / "shared/data/wiki/corpus.jsonl"
    out = tmp_path_factory.mktemp("env-bm25") / "index"
    build_index(BuildConfig(kind="bm25", corpus=str(corpus), out=str(out), show_progress=False))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(
        [sys.executable, "-m", "retriever.cli", "serve", "--index", str(out), "--port", str(port)],
        cwd=Path(__file__).resolve().parents[2], stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"retriever server exited: {proc.stdout.read()}")
        try:
            if httpx.get(f"{url}/health", timeout=1.0).status_code == 200:
                break
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            proc.kill()
            raise TimeoutError("retriever server not healthy after 120 s")
        time.sleep(0.1)
    yield url
    proc.terminate()
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
