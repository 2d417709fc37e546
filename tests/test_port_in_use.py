"""A port in use: ``copc env serve``, ``copc retriever serve`` and ``copc view --serve`` exit with
status 2 and one line naming ``--port`` and the port, before printing that they serve (issue 42
item 5a). A real socket listens on the port on 127.0.0.1."""

from __future__ import annotations

import json
import socket
import subprocess
import sys

import pytest

from retriever.access import check_port

COPC = [sys.executable, "-m", "trainer.cli"]


@pytest.fixture
def busy_port():
    """A port another socket listens on (127.0.0.1), for the test's duration."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


def _one_line(res: subprocess.CompletedProcess, prefix: str, port: int) -> str:
    lines = res.stderr.strip().splitlines()
    assert res.returncode == 2, res.stderr
    assert len(lines) == 1, res.stderr
    assert lines[0] == (f"{prefix}--port {port}: in use on 127.0.0.1 (another process listens there; "
                        "pick another port, or 0 for a free one)")
    assert "serving" not in res.stdout + res.stderr and "Traceback" not in res.stderr
    return lines[0]


def test_check_port_refuses_a_listening_port_and_passes_a_free_one(busy_port):
    with pytest.raises(ValueError, match=rf"^--port {busy_port}: in use on 127.0.0.1 "):
        check_port("127.0.0.1", busy_port)
    check_port("127.0.0.1", 0)  # any free port: not checked
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        free = s.getsockname()[1]
    check_port("127.0.0.1", free)


def test_env_serve_port_in_use(busy_port):
    res = subprocess.run([*COPC, "env", "serve", "--env", "search", "--port", str(busy_port),
                          "retriever_url=http://127.0.0.1:9"], capture_output=True, text=True, timeout=120)
    _one_line(res, "copc env serve: ", busy_port)


def test_retriever_serve_port_in_use(busy_port, tmp_path):
    corpus = tmp_path / "c.jsonl"
    corpus.write_text("".join(json.dumps({"id": str(i), "contents": f'"T{i}"\nalpha {w}'}) + "\n"
                              for i, w in enumerate(["gamma", "delta"])))
    subprocess.run([*COPC, "retriever", "build", "--corpus", str(corpus), "--out", str(tmp_path / "idx"),
                    "--no-progress"], check=True, capture_output=True, timeout=120)
    res = subprocess.run([*COPC, "retriever", "serve", "--index", str(tmp_path / "idx"),
                          "--port", str(busy_port)],
                         capture_output=True, text=True, timeout=120)
    _one_line(res, "copc retriever: error: ValueError: ", busy_port)


def test_view_serve_port_in_use(busy_port, tmp_path):
    res = subprocess.run([*COPC, "view", str(tmp_path), "--serve", "--port", str(busy_port)],
                         capture_output=True, text=True, timeout=120)
    _one_line(res, "copc view: ", busy_port)
    assert not (tmp_path / "view.html").exists()
