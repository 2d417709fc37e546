"""Start a retriever server as a subprocess and wait until it is healthy (used by ``copc train``
for search tasks and by the test fixtures).

``start_server`` runs ``python -m retriever.cli serve`` on 127.0.0.1 at a free port, polls
``GET /health`` and returns a handle whose ``stop()`` terminates it (kill after a grace period).
``ensure_bm25_index`` builds a BM25 index on first use and reuses it afterwards.
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO

import httpx

# The directory holding the ``retriever`` package (the server subprocess's working directory, so
# ``python -m retriever.cli`` imports this very copy; package code, not data).
REPO = Path(__file__).resolve().parents[1]


def free_port() -> int:
    """A free TCP port on 127.0.0.1 (race-free enough for tests and local runs)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_healthy(url: str, proc: subprocess.Popen, timeout_s: float = 120.0,
                 output: Path | None = None) -> None:
    """Poll ``url/health`` until it answers 200.

    Args:
        url: server base URL. proc: the server process. timeout_s: seconds to wait.
        output: file holding the server's output (quoted on failure); default: ``proc.stdout``.

    Raises:
        RuntimeError: the process exited (with its output).
        TimeoutError: not healthy within ``timeout_s`` (the process is killed).
    """
    deadline = time.monotonic() + timeout_s
    while True:
        if proc.poll() is not None:
            out = output.read_text()[-4000:] if output else (proc.stdout.read() if proc.stdout else "")
            raise RuntimeError(f"server at {url} exited with {proc.returncode}:\n{out}")
        with contextlib.suppress(httpx.TransportError):
            if httpx.get(f"{url}/health", timeout=1.0).status_code == 200:
                return
        if time.monotonic() > deadline:
            proc.kill()
            raise TimeoutError(f"server at {url} not healthy after {timeout_s:.0f} s")
        time.sleep(0.1)


@dataclass
class ServerProcess:
    """A running retriever server: ``url`` and ``stop()``."""

    proc: subprocess.Popen
    url: str
    log: IO[str] | None = None

    def stop(self, grace_s: float = 10.0) -> None:
        """Terminate the server (kill after ``grace_s`` seconds); idempotent."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.log is not None and not self.log.closed:
            self.log.close()


def start_server(index_dir: str | Path, *, port: int | None = None, extra_args: tuple[str, ...] = (),
                 timeout_s: float = 120.0, log_path: str | Path | None = None) -> ServerProcess:
    """Start ``retriever.cli serve --index index_dir`` on 127.0.0.1 and wait for ``/health``.

    Args:
        index_dir: an index built by ``copc retriever build`` (relative: to the current working
            directory).
        port: TCP port (default: a free one).
        extra_args: more ``serve`` options (e.g. ``("--max-topk", "10")``).
        timeout_s: seconds to wait for health.
        log_path: write the server's output there (default: a pipe, read on failure).

    Returns:
        The running :class:`ServerProcess`.

    Raises:
        RuntimeError / TimeoutError: see :func:`wait_healthy` (the process is cleaned up).
    """
    port = port or free_port()
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1"}
    index_dir = Path(index_dir).expanduser().resolve()  # the server runs in another directory
    args = [sys.executable, "-m", "retriever.cli", "serve", "--index", str(index_dir), "--port", str(port),
            "--parent-pid", str(os.getpid()), *extra_args]  # never outlives us, even after a kill -9
    log = Path(log_path).open("w") if log_path else None  # noqa: SIM115 - owned by the returned handle
    proc = subprocess.Popen(args, cwd=REPO, env=env, stdout=log or subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    server = ServerProcess(proc, f"http://127.0.0.1:{port}", log)
    try:
        wait_healthy(server.url, proc, timeout_s, Path(log_path) if log_path else None)
    except BaseException:
        server.stop()
        raise
    return server


def ensure_bm25_index(corpus: str | Path, index_dir: str | Path, show_progress: bool = False) -> Path:
    """Build a BM25 index of ``corpus`` in ``index_dir`` unless one is there already.

    The index is complete when its ``meta.json`` exists (written last by the build); loading
    it checks the corpus checksum, so an index of another corpus fails clearly at serve time.

    Returns:
        ``index_dir`` as a :class:`~pathlib.Path`.
    """
    index_dir = Path(index_dir)
    if not (index_dir / "meta.json").is_file():
        from .index import BuildConfig, build_index

        index_dir.parent.mkdir(parents=True, exist_ok=True)
        build_index(BuildConfig(kind="bm25", corpus=str(corpus), out=str(index_dir),
                                show_progress=show_progress))
    return index_dir
