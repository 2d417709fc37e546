"""A pool of warm sandboxed fork-server workers: ``Sandbox(config).run(code) -> SandboxResult``."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import queue
import selectors
import shutil
import signal
import struct
import subprocess
import tempfile
import threading
import time
import warnings
from dataclasses import replace

from .config import (
    STATUS_CPU,
    STATUS_ERROR,
    STATUS_FILE_SIZE,
    STATUS_MEMORY,
    STATUS_OK,
    STATUS_OUTPUT,
    STATUS_SANDBOX_ERROR,
    STATUS_SIGNAL,
    STATUS_TIMEOUT,
    SandboxConfig,
    SandboxResult,
    SandboxUnavailableError,
)
from .host import PoolCgroups, UidClaim
from .launch import BWRAP_HINT, LaunchSpec, bwrap_argv, process_argv, sandbox_binds
from .selfcheck import PROBE, check_probe

log = logging.getLogger(__name__)
_HEADER = struct.Struct(">I")
_GRACE_S = 5.0  # extra host-side wait beyond the call's own timeout before the worker is shot


class _WorkerDiedError(RuntimeError):
    pass


class _Worker:
    """One sandboxed fork server (a ``bwrap`` or plain process tree) and its pipes."""

    def __init__(self, spec: LaunchSpec, slot: int) -> None:
        self.spec, self.slot = spec, slot
        self.errlog = tempfile.TemporaryFile()  # noqa: SIM115 - lives as long as the worker
        self.proc = subprocess.Popen(
            spec.argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.errlog,
            env=spec.env, start_new_session=True, close_fds=True,
        )
        self.out_fd = self.proc.stdout.fileno()
        self.sel = selectors.DefaultSelector()
        self.sel.register(self.out_fd, selectors.EVENT_READ)
        self.hello: dict = {}

    def stderr_tail(self, n: int = 2000) -> str:
        self.errlog.seek(0)
        return self.errlog.read().decode(errors="replace")[-n:]

    def _read_exact(self, n: int, deadline: float) -> bytes:
        buf = bytearray()
        while len(buf) < n:
            left = deadline - time.monotonic()
            if left <= 0 or not self.sel.select(left):
                raise TimeoutError
            chunk = os.read(self.out_fd, n - len(buf))
            if not chunk:
                raise _WorkerDiedError(f"worker exited (rc={self.proc.poll()}): {self.stderr_tail()}")
            buf += chunk
        return bytes(buf)

    def recv(self, timeout_s: float) -> dict:
        deadline = time.monotonic() + timeout_s
        (n,) = _HEADER.unpack(self._read_exact(4, deadline))
        return json.loads(self._read_exact(n, deadline))

    def send(self, msg: dict) -> None:
        data = json.dumps(msg).encode()
        try:
            self.proc.stdin.write(_HEADER.pack(len(data)) + data)
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError) as e:
            raise _WorkerDiedError(f"worker pipe closed: {e}; {self.stderr_tail()}") from e

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:  # pragma: no cover - SIGKILL should not hang
            log.error("sandbox worker %d did not die", self.proc.pid)
        for f in (self.proc.stdin, self.proc.stdout):
            with contextlib.suppress(OSError):
                f.close()
        self.sel.close()
        self.errlog.close()
        if self.spec.host_tmp:
            shutil.rmtree(self.spec.host_tmp, ignore_errors=True)


def _classify(reply: dict, cfg_timeout: float, memory_mb: int) -> tuple[str, str | None]:
    """Map the worker's raw reply to (status, reason)."""
    code = reply["exit_code"]
    if reply.get("reason") == "timeout":
        return STATUS_TIMEOUT, f"wall-clock timeout after {cfg_timeout:g} s; process tree killed"
    if reply.get("reason") == "memory":
        return STATUS_MEMORY, (f"memory limit of {memory_mb} MiB for the whole call reached "
                               "(cgroup: all its processes, files and shared memory); call killed")
    if reply.get("reason") == "output_limit":
        return STATUS_OUTPUT, "output exceeded max_output_bytes; process killed, output truncated"
    if code == 0:
        return STATUS_OK, None
    if code < 0:
        sig = -code
        name = signal.Signals(sig).name if sig in signal.valid_signals() else str(sig)
        if sig == signal.SIGXCPU or (sig == signal.SIGKILL and reply["cpu_s"] >= cfg_timeout):
            return STATUS_CPU, f"CPU-time limit reached ({name})"
        if sig == signal.SIGXFSZ:
            return STATUS_FILE_SIZE, "file-size limit (RLIMIT_FSIZE) reached (SIGXFSZ)"
        hint = " (segmentation fault, e.g. C-stack overflow from deep recursion)" if (
            sig == signal.SIGSEGV) else ""
        return STATUS_SIGNAL, f"killed by {name}{hint}"
    lines = [ln for ln in reply["stderr"].strip().splitlines() if ln.strip()]
    last = lines[-1] if lines else ""
    if last.startswith("MemoryError"):
        return STATUS_MEMORY, f"address-space limit of {memory_mb} MiB reached (MemoryError)"
    if "[Errno 27]" in last:  # EFBIG: Python ignores SIGXFSZ, so the write fails instead
        return STATUS_FILE_SIZE, f"file-size limit (RLIMIT_FSIZE) reached: {last}"
    return STATUS_ERROR, f"exited with status {code}" + (f": {last}" if last else "")


class Sandbox:
    """Pool of warm sandboxed Python workers; thread-safe ``run`` with per-call limits.

    Each worker is a fork server inside the isolation (see ``SandboxConfig.isolation`` and
    docs/environments.md); a call forks a fresh child, so there is no interpreter start-up per
    call and no state is shared between calls. A worker that dies or hangs is replaced.

    Raises:
        SandboxUnavailableError: the isolation cannot be set up here, or a start-up self-check
            (non-root uid, no capabilities, loopback-only network, own PID namespace) fails.
    """

    def __init__(self, config: SandboxConfig | None = None, **overrides: object) -> None:
        cfg = config or SandboxConfig()
        self.config = replace(cfg, **overrides) if overrides else cfg
        self._closed = False
        self._lock = threading.Lock()
        self._docker = None
        if self.config.isolation == "docker":
            from .docker_backend import DockerBackend

            self._docker = DockerBackend(self.config)
            return
        if self.config.isolation == "process":
            warnings.warn(
                "SandboxConfig(isolation='process') is WEAKER than the default 'bwrap': no "
                "read-only file system, no PID namespace, no uid change; only rlimits, a scrubbed "
                "environment and (where unshare is permitted) a network namespace.",
                RuntimeWarning, stacklevel=2,
            )
        self._idle: queue.Queue[_Worker] = queue.Queue()
        self._all: dict[int, _Worker] = {}
        self._uids: UidClaim | None = None
        self._cgroups = PoolCgroups(self.config.max_processes, self.config.workers)
        started: list[_Worker] = []
        try:
            if self.config.isolation == "bwrap" and os.geteuid() == 0:
                self._uids = UidClaim(self.config.uid_base, self.config.workers)
            started += [self._spawn(slot) for slot in range(self.config.workers)]
            for w in started:
                self._handshake(w)
                self._idle.put(w)
        except BaseException:
            for w in started:
                w.kill()
            self._release_host()
            raise

    # -- worker lifecycle ------------------------------------------------------------------
    def _spawn(self, slot: int) -> _Worker:
        bwrap = self.config.isolation == "bwrap"
        try:
            cgroups = self._cgroups.slot(slot) if bwrap else {}
        except OSError as e:
            raise SandboxUnavailableError(f"cannot set up the cgroups of sandbox worker {slot}: "
                                          f"{e}") from e
        uid = self._uids.uids[slot] if self._uids is not None else None
        spec = (bwrap_argv if bwrap else process_argv)(self.config, slot, uid, cgroups)
        w = _Worker(spec, slot)
        with self._lock:
            self._all[slot] = w
        return w

    def _handshake(self, w: _Worker) -> None:
        """Read the worker's hello, then run the self-check probe as an ordinary call.

        Raises:
            SandboxUnavailableError: the worker did not start, or the probe found weaker
                confinement than documented (it never runs weaker silently).
        """
        try:
            hello = w.recv(60.0)
        except (TimeoutError, _WorkerDiedError) as e:
            hint = BWRAP_HINT if self.config.isolation == "bwrap" else "check SandboxConfig.python"
            raise SandboxUnavailableError(
                f"sandbox worker ({self.config.isolation}) failed to start: {e!s}; "
                f"stderr: {w.stderr_tail()!r}; {hint}") from None
        problems = [f"worker set-up failed: {hello['setup_error']}"] if hello.get(
            "setup_error") else []
        if hello.get("preload_errors"):
            problems.append(f"preload failed: {hello['preload_errors']}")
        probe: dict = {}
        if not problems:
            res = self._call(w, PROBE, 30.0, max(self.config.memory_mb, 256))
            try:
                probe = json.loads(res.stdout)
            except ValueError:
                problems.append(f"self-check probe failed: {res.status}: {res.reason}; "
                                f"{res.stderr[-1000:]!r}")
        if probe and self.config.isolation == "bwrap":
            bound = tuple(inside for _, inside in sandbox_binds(self.config))
            problems += check_probe(probe, hello, self._cgroups.mode, bound)
        if problems:
            raise SandboxUnavailableError(
                "sandbox self-check failed, refusing to run with weaker isolation: "
                + "; ".join(problems))
        hello.update({
            "child_uid": probe.get("uid"), "child_cap_eff": probe.get("caps", {}).get("CapEff"),
            "capabilities": probe.get("caps"), "no_new_privs": probe.get("nnp"),
            "seccomp": probe.get("seccomp"), "user_namespaces": probe.get("user_namespaces"),
            "net_interfaces": probe.get("net_interfaces"),
            "memory_limit": ("cgroup-v1 memory+pids (whole call)" if self._cgroups.mode ==
                             "cgroup-v1" else f"rlimit per process ({self._cgroups.why})"),
        })
        w.hello = hello

    def _replace(self, w: _Worker) -> _Worker:
        w.kill()
        nw = self._spawn(w.slot)
        self._handshake(nw)
        return nw

    def worker_pids(self) -> list[int]:
        """Host pids of the worker process trees (``bwrap`` / interpreter), one per slot."""
        with self._lock:
            return [w.proc.pid for w in self._all.values()]

    @property
    def enforced(self) -> dict:
        """What the workers verified at start-up (uid, capabilities, interfaces, ...)."""
        if self._docker is not None:
            return {"isolation": "docker"}
        with self._lock:
            hellos = [w.hello for w in self._all.values()]
        return {"isolation": self.config.isolation, "workers": hellos,
                "memory_limit": self._cgroups.mode, "memory_limit_why": self._cgroups.why,
                "cpu_limit": self._cgroups.cpu_mode, "cpu_limit_why": self._cgroups.cpu_why}

    # -- calls -----------------------------------------------------------------------------
    def run(self, code: str, timeout_s: float | None = None,
            memory_mb: int | None = None) -> SandboxResult:
        """Run Python source ``code`` as a script in a fresh sandboxed process.

        Args:
            code: Python source (stdin is empty; cwd is a fresh private temp dir).
            timeout_s: wall-clock limit in seconds (default ``config.timeout_s``); the CPU
                limit is ``ceil(timeout_s) + 1`` s.
            memory_mb: address-space limit in MiB (default ``config.memory_mb``).

        Returns:
            :class:`SandboxResult`; limits hit are reported in ``status``/``reason``, never
            raised.

        Raises:
            TypeError / ValueError: bad ``code``, ``timeout_s`` or ``memory_mb``.
            RuntimeError: the sandbox was closed.
        """
        if not isinstance(code, str):
            raise TypeError(f"code must be str, got {type(code).__name__}")
        timeout_s = self.config.timeout_s if timeout_s is None else float(timeout_s)
        memory_mb = self.config.memory_mb if memory_mb is None else int(memory_mb)
        if not timeout_s > 0:
            raise ValueError(f"timeout_s={timeout_s!r}: must be > 0 seconds")
        if memory_mb < 64:
            raise ValueError(f"memory_mb={memory_mb!r}: must be >= 64 (MiB)")
        if self._closed:
            raise RuntimeError("Sandbox is closed")
        if self._docker is not None:
            return self._docker.run(code, timeout_s, memory_mb)
        t0 = time.perf_counter()
        w = self._idle.get()
        try:
            res = self._call(w, code, timeout_s, memory_mb)
            if res.status == STATUS_SANDBOX_ERROR:  # the machinery failed: once more, fresh
                w = self._replace(w)
                first = res.reason
                res = self._call(w, code, timeout_s, memory_mb)
                if res.status == STATUS_SANDBOX_ERROR:
                    w = self._replace(w)
                    res = replace(res, reason=f"{res.reason} (retried once after: {first})")
        finally:
            self._idle.put(w)
        return replace(res, wall_s=time.perf_counter() - t0)

    def _call(self, w: _Worker, code: str, timeout_s: float, memory_mb: int) -> SandboxResult:
        """One request to worker ``w``; a failure of the worker is a ``sandbox_error``
        result (the caller replaces the worker)."""
        req = {
            "code": code, "timeout_s": timeout_s, "memory_mb": memory_mb,
            "cpu_s": int(timeout_s) + 1, "max_output_bytes": self.config.max_output_bytes,
            "max_file_bytes": self.config.max_file_mb * 1024 * 1024,
            "max_processes": self.config.max_processes,
            "env": self.config.env,
        }
        try:
            w.send(req)
            reply = w.recv(timeout_s + _GRACE_S)
            if "error" in reply:
                raise _WorkerDiedError(reply["error"])
        except (TimeoutError, _WorkerDiedError, json.JSONDecodeError) as e:
            msg = "worker did not answer in time" if isinstance(e, TimeoutError) else str(e)
            return SandboxResult(stdout="", stderr="", exit_code=None,
                                 status=STATUS_SANDBOX_ERROR,
                                 reason=f"sandbox worker failed and was replaced: {msg}")
        status, reason = _classify(reply, timeout_s, memory_mb)
        return SandboxResult(
            stdout=reply["stdout"], stderr=reply["stderr"], exit_code=reply["exit_code"],
            status=status, reason=reason, truncated=reply["truncated"],
            duration_s=reply["duration_s"], cpu_s=reply["cpu_s"],
            max_rss_kb=reply["max_rss_kb"],
        )

    def close(self) -> None:
        """Kill all workers (idempotent)."""
        if self._closed:
            return
        self._closed = True
        if self._docker is not None:
            self._docker.close()
            return
        with self._lock:
            workers = list(self._all.values())
            self._all.clear()
        for w in workers:
            w.kill()
        self._release_host()

    def _release_host(self) -> None:
        if getattr(self, "_cgroups", None) is not None:
            self._cgroups.close()
        if getattr(self, "_uids", None) is not None:
            self._uids.release()

    def __enter__(self) -> Sandbox:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.close()


def run(code: str, timeout_s: float = 10.0, memory_mb: int = 1024,
        sandbox: Sandbox | None = None) -> SandboxResult:
    """Run ``code`` once in the default (bwrap) sandbox; see :meth:`Sandbox.run`.

    Without ``sandbox`` a one-worker pool is started and closed for this call (~0.1 s of
    start-up); keep a :class:`Sandbox` for repeated calls.
    """
    if sandbox is not None:
        return sandbox.run(code, timeout_s=timeout_s, memory_mb=memory_mb)
    with Sandbox(SandboxConfig(workers=1)) as sb:
        return sb.run(code, timeout_s=timeout_s, memory_mb=memory_mb)
