"""Start ``copc env serve`` as a subprocess and wait until it is healthy (tests, benchmarks,
local runs): ``start_env_server("math_tool", port=None) -> ServerProcess`` with ``.url`` and
``.stop()``.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

from retriever.launch import ServerProcess, free_port, wait_healthy

#: The repository root (the server subprocess's working directory).
REPO = Path(__file__).resolve().parents[2]


def start_env_server(env: str, *settings: str, port: int | None = None, extra_args: tuple[str, ...] = (),
                     timeout_s: float = 120.0, log_path: str | Path | None = None,
                     cwd: str | Path | None = None) -> ServerProcess:
    """Run ``python -m trainer.cli env serve --env ENV`` on 127.0.0.1 and wait for ``/health``.

    Args:
        env: environment id (or ``module:id`` / ``file.py:id``).
        *settings: ``key=value`` environment settings.
        port: TCP port (default: a free one).
        extra_args: more ``serve`` options (``("--max-sessions", "8", "--token-file", F)``).
        timeout_s: seconds to wait for health.
        log_path: write the server's output there (default: a temporary file; quoted on failure).
        cwd: working directory of the server (default: the repository root).

    Returns:
        The running server (``url``: ``http://127.0.0.1:PORT``); it exits with this process.

    Raises:
        RuntimeError: the server exited (its output is in the message). TimeoutError: not
            healthy in time (it is killed).
    """
    port = port or free_port()
    env_vars = {**os.environ, "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1",
                "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)}
    args = [sys.executable, "-m", "trainer.cli", "env", "serve", "--env", env, "--port", str(port),
            "--parent-pid", str(os.getpid()), *extra_args, *settings]
    if log_path is None:
        with tempfile.NamedTemporaryFile("w", prefix="copc-env-server-", suffix=".log", delete=False) as f:
            log_path = f.name
    log = Path(log_path).open("w")  # noqa: SIM115 - owned by the returned handle
    proc = subprocess.Popen(args, cwd=str(cwd or REPO), env=env_vars, stdout=log, stderr=subprocess.STDOUT,
                            text=True)
    server = ServerProcess(proc, f"http://127.0.0.1:{port}", log)
    try:
        wait_healthy(server.url, proc, timeout_s, Path(log_path))
    except BaseException:
        server.stop()
        raise
    return server


__all__ = ["ServerProcess", "start_env_server"]
