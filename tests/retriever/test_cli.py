"""``copc retriever build`` / ``serve`` through the real console script."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import httpx

from .conftest import free_port, start_process, stop_process

COPC = [sys.executable, "-m", "trainer.cli"]


def _corpus(path: Path, words: list[str]) -> Path:
    path.write_text(
        "".join(
            json.dumps({"id": str(i), "contents": f'"T{i}"\nalpha {w}'}) + "\n" for i, w in enumerate(words)
        )
    )
    return path


def test_build_then_serve_via_cli(tmp_path):
    corpus = _corpus(tmp_path / "c.jsonl", ["gamma", "delta", "epsilon"])
    out = tmp_path / "idx"
    r = subprocess.run(
        [
            *COPC,
            "retriever",
            "build",
            "--corpus",
            str(corpus),
            "--kind",
            "bm25",
            "--out",
            str(out),
            "--no-progress",
        ],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 0, r.stderr
    assert "built bm25 index of 3 passages" in r.stderr
    meta = json.loads((out / "meta.json").read_text())
    assert meta["num_passages"] == 3 and meta["encoder"] == "bm25s" and meta["dimension"] == 0
    assert len(meta["corpus_sha256"]) == 64

    port = free_port()
    proc, url = start_process(
        ["-m", "trainer.cli", "retriever", "serve", "--index", str(out), "--port", str(port)], port
    )
    try:
        res = httpx.post(f"{url}/retrieve", json={"queries": ["delta"], "topk": 1}).json()
        assert res == {"result": [[{"document": {"id": "1", "contents": '"T1"\nalpha delta'}}]]}
    finally:
        stop_process(proc)


def test_serve_refuses_other_corpus(tmp_path):
    corpus = _corpus(tmp_path / "c.jsonl", ["gamma", "delta"])
    other = _corpus(tmp_path / "o.jsonl", ["gamma", "zeta"])
    out = tmp_path / "idx"
    subprocess.run(
        [*COPC, "retriever", "build", "--corpus", str(corpus), "--out", str(out), "--no-progress"],
        check=True,
        capture_output=True,
    )
    r = subprocess.run(
        [
            *COPC,
            "retriever",
            "serve",
            "--index",
            str(out),
            "--corpus",
            str(other),
            "--port",
            str(free_port()),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode != 0
    assert "IndexMismatchError" in r.stderr and "rebuild the index" in r.stderr


def test_bad_corpus_line_reported(tmp_path):
    corpus = tmp_path / "c.jsonl"
    corpus.write_text('{"id": "0", "contents": "ok"}\n{"id": "1"}\n')
    r = subprocess.run(
        [*COPC, "retriever", "build", "--corpus", str(corpus), "--out", str(tmp_path / "idx")],
        capture_output=True,
        text=True,
    )
    assert r.returncode != 0 and "c.jsonl:2: missing field 'contents'" in r.stderr
