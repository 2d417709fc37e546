"""One inference server as a subprocess: what the SGLang and vLLM launchers share.

:class:`ServerLauncher` starts a command line in its own process group (session), polls a health
URL until it answers 200, quotes the tail of the server log when the process dies or the wait times
out, and ends the whole group (the server and every process it forked) on :meth:`~ServerLauncher.close`,
on leaving the context manager, on garbage collection and at interpreter exit (``weakref.finalize``),
so no server is left behind as an orphan. A subclass says which command and environment
(:meth:`~ServerLauncher.build_argv`, :meth:`~ServerLauncher.build_env`), its name in messages and its
error class; its config carries the common fields (see :class:`ServerLauncher`).
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import tempfile
import time
import weakref
from collections import deque
from pathlib import Path
from typing import Any


class ServerLaunchError(RuntimeError):
    """The server exited during start-up or did not become healthy in time.

    The message carries the exit status (if any) and the tail of the server log.
    """


def free_port(host: str = "127.0.0.1") -> int:
    """Return a TCP port that was free on ``host`` a moment ago (OS-assigned)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def _wait_group_gone(proc: subprocess.Popen, timeout_s: float) -> bool:
    """Wait up to ``timeout_s`` seconds for every process of ``proc``'s group to end."""
    deadline = time.monotonic() + timeout_s
    while True:
        proc.poll()  # reap the leader so it does not keep the group alive as a zombie
        try:
            os.killpg(proc.pid, 0)
        except ProcessLookupError:
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)


def kill_group(proc: subprocess.Popen, grace_s: float) -> None:
    """SIGTERM the process group led by ``proc``, SIGKILL it after ``grace_s`` seconds.

    Signals the whole group even if the leader already exited (its children may live on).
    """
    pgid = proc.pid  # start_new_session=True: the leader's pid is the group id
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 10.0)):
        try:
            os.killpg(pgid, sig)
        except ProcessLookupError:
            break
        if _wait_group_gone(proc, wait_s):
            break
    with contextlib.suppress(subprocess.TimeoutExpired):  # SIGKILL was sent; reap if we can
        proc.wait(timeout=5)


class ServerLauncher:
    """Runs one server subprocess; use as a context manager. Subclasses set :attr:`label`,
    :attr:`error_cls`, :attr:`log_prefix` and implement :meth:`build_argv` (and :meth:`build_env`).

    ``config`` must have the attributes ``model_path`` (a directory), ``host``, ``port`` (None: a
    free one), ``health_path``, ``startup_timeout_s``, ``poll_interval_s``, ``shutdown_grace_s``,
    ``log_path`` (None: a temporary file), ``log_tail_lines`` and ``show_progress``.

    Raises:
        ServerLaunchError: (``error_cls``) from :meth:`start` if the server dies or times out.
    """

    #: the server's name in messages and in the progress bar
    label = "server"
    #: the exception :meth:`start` raises (a :class:`ServerLaunchError` subclass)
    error_cls: type[ServerLaunchError] = ServerLaunchError
    #: prefix of the temporary log file's name
    log_prefix = "server-"

    def __init__(self, config: Any) -> None:
        """Keep ``config``; nothing starts until :meth:`start`."""
        self.config = config
        self.port: int | None = None
        self.proc: subprocess.Popen | None = None
        self.log_path: Path | None = None
        self._finalizer: weakref.finalize | None = None

    def build_argv(self, port: int) -> list[str]:
        """The command line that starts the server on ``port`` (subclasses)."""
        raise NotImplementedError

    def build_env(self) -> dict[str, str]:
        """The server's environment (default: this process's)."""
        return dict(os.environ)

    @property
    def url(self) -> str:
        """Base URL of the server, e.g. ``http://127.0.0.1:30000``.

        Raises:
            RuntimeError: before :meth:`start`.
        """
        if self.port is None:
            raise RuntimeError(f"{type(self).__name__}.url: the server has not been started")
        return f"http://{self.config.host}:{self.port}"

    @property
    def command(self) -> list[str]:
        """The command line of the running (or last started) server.

        Raises:
            RuntimeError: before :meth:`start`.
        """
        if self.port is None:
            raise RuntimeError(f"{type(self).__name__}.command: the server has not been started")
        return self.build_argv(self.port)

    def start(self) -> ServerLauncher:
        """Start the server and wait until ``health_path`` answers 200.

        Returns:
            self.

        Raises:
            ValueError: ``model_path`` is not a directory.
            RuntimeError: already started.
            ServerLaunchError: (``error_cls``) the process exited, or no healthy answer within
                ``startup_timeout_s`` (the process group is killed first); the message quotes the
                last ``log_tail_lines`` lines of the server log.
        """
        cfg = self.config
        if self.proc is not None and self.proc.poll() is None:
            raise RuntimeError(f"{type(self).__name__}.start: already running")
        if not Path(cfg.model_path).is_dir():
            raise ValueError(f"{type(cfg).__name__}.model_path={cfg.model_path!r}: not a directory")
        self.port = cfg.port if cfg.port is not None else free_port(cfg.host)
        if cfg.log_path is not None:
            self.log_path = Path(cfg.log_path)
            self.log_path.parent.mkdir(parents=True, exist_ok=True)
        else:
            fd, name = tempfile.mkstemp(prefix=self.log_prefix, suffix=".log")
            os.close(fd)
            self.log_path = Path(name)
        env = self.build_env()
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(self.command, stdout=log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, env=env, start_new_session=True)
        self._finalizer = weakref.finalize(self, kill_group, self.proc, cfg.shutdown_grace_s)
        try:
            self._wait_healthy()
        except BaseException:
            self.close()
            raise
        return self

    def _wait_healthy(self) -> None:
        """Poll ``health_path`` until 200, the process exits, or the timeout passes."""
        import httpx  # here, not at import: engines are registered when a config is validated
        from tqdm import tqdm

        cfg = self.config
        assert self.proc is not None
        url = self.url + cfg.health_path
        start = time.monotonic()
        # disable=None: no bar where stderr is not a terminal (a log file, a Ray worker's captured
        # output: one line per second of start-up otherwise)
        bar = tqdm(total=round(cfg.startup_timeout_s), desc=f"{self.label} start-up", unit="s",
                   disable=None if cfg.show_progress else True, leave=False)
        try:
            with httpx.Client(timeout=httpx.Timeout(30.0, connect=2.0)) as client:
                while True:
                    rc = self.proc.poll()
                    if rc is not None:
                        raise self.error_cls(
                            f"{self.label} exited with status {rc} during start-up "
                            f"(command: {' '.join(self.command)}); last log lines "
                            f"({self.log_path}):\n{self.log_tail()}")
                    try:
                        if client.get(url).status_code == 200:
                            return
                    except httpx.TransportError:
                        pass
                    elapsed = time.monotonic() - start
                    bar.n = min(round(elapsed), bar.total)
                    bar.refresh()
                    if elapsed > cfg.startup_timeout_s:
                        raise self.error_cls(
                            f"{self.label} not healthy at {url} after {cfg.startup_timeout_s:.0f} s "
                            f"(command: {' '.join(self.command)}); last log lines "
                            f"({self.log_path}):\n{self.log_tail()}")
                    time.sleep(cfg.poll_interval_s)
        finally:
            bar.close()

    def log_tail(self, lines: int | None = None) -> str:
        """The last ``lines`` (default ``log_tail_lines``) lines of the server log."""
        if self.log_path is None or not self.log_path.exists():
            return "<no log>"
        with open(self.log_path, errors="replace") as f:
            return "".join(deque(f, maxlen=lines or self.config.log_tail_lines))

    @property
    def running(self) -> bool:
        """Whether the server's leader process is alive."""
        return self.proc is not None and self.proc.poll() is None

    def close(self) -> None:
        """Kill the server's whole process group (SIGTERM, then SIGKILL); idempotent."""
        if self._finalizer is not None:
            self._finalizer()  # runs kill_group once and detaches it from atexit

    def __enter__(self) -> ServerLauncher:
        """Start the server (see :meth:`start`)."""
        return self.start()

    def __exit__(self, *exc: object) -> None:
        """Kill the server."""
        self.close()
