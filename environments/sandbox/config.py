"""Typed configuration and result records for the Python sandbox."""

from __future__ import annotations

import sys
from dataclasses import dataclass, field

ISOLATIONS = ("bwrap", "process", "docker")

# Outcome labels of :class:`SandboxResult.status`.
STATUS_OK = "ok"  # exited with status 0
STATUS_ERROR = "error"  # non-zero exit (exception, sys.exit(n), syntax error)
STATUS_TIMEOUT = "timeout"  # wall-clock limit hit; whole process tree killed
STATUS_CPU = "cpu_limit"  # RLIMIT_CPU hit (SIGXCPU / SIGKILL)
STATUS_MEMORY = "memory_limit"  # the call's memory cgroup OOM-killed it, or RLIMIT_AS hit
STATUS_OUTPUT = "output_limit"  # stdout+stderr exceeded max_output_bytes; killed
STATUS_FILE_SIZE = "file_size_limit"  # RLIMIT_FSIZE hit (SIGXFSZ)
STATUS_SIGNAL = "signal"  # killed by another signal (e.g. SIGSEGV on C-stack overflow)
STATUS_SANDBOX_ERROR = "sandbox_error"  # the worker failed twice (replaced, call retried once)


class SandboxUnavailableError(RuntimeError):
    """The requested isolation cannot be provided on this machine (message says why/how)."""


@dataclass(frozen=True)
class SandboxConfig:
    """Settings of a :class:`~environments.sandbox.Sandbox` pool (validated on creation).

    Attributes:
        isolation: ``"bwrap"`` (default, OS-level, see docs/environments.md), ``"process"``
            (rlimits + network namespace only; emits a warning) or ``"docker"`` (Docker SDK;
            needs a reachable daemon).
        workers: number of warm fork-server workers (parallel calls), >= 1.
        timeout_s: default wall-clock limit per call, seconds (> 0).
        memory_mb: default memory limit per call, MiB (>= 64): the call's cgroup limit (all
            its processes, tmpfs and shared memory) where cgroups are available, and RLIMIT_AS
            of each process (docs/environments.md).
        max_output_bytes: stdout + stderr kept per call, bytes; more kills the call.
        max_file_mb: largest file the code may write (RLIMIT_FSIZE), MiB.
        tmp_size_mb: size of each call's fresh tmpfs ``/tmp`` (and ``/dev/shm``), MiB.
        max_processes: processes per call (the call's ``pids.max`` and RLIMIT_NPROC of the
            worker's own uid; fork-bomb cap), >= 2.
        uid_base: when the host runs as root, each worker runs code as a uid/gid claimed for
            this pool alone from ``[uid_base, uid_base + 4096)`` (unused by any process and by
            any other pool), so RLIMIT_NPROC counts only that worker's call.
        python: interpreter used inside the sandbox (its prefix is bound read-only).
        preload_modules: imported once in each fork server (e.g. ``("numpy", "sympy")``),
            so calls do not pay for the import.
        extra_ro_paths: further host paths bound read-only at the same place.
        env: environment variables visible to the code (everything else is scrubbed).
        docker_image: image for the docker backend.
    """

    isolation: str = "bwrap"
    workers: int = 2
    timeout_s: float = 10.0
    memory_mb: int = 1024
    max_output_bytes: int = 64 * 1024
    max_file_mb: int = 16
    tmp_size_mb: int = 64
    max_processes: int = 32
    uid_base: int = 61000
    python: str = sys.executable
    preload_modules: tuple[str, ...] = ()
    extra_ro_paths: tuple[str, ...] = ()
    env: dict[str, str] = field(
        default_factory=lambda: {
            "PATH": "/usr/local/bin:/usr/bin:/bin",
            "LANG": "C.UTF-8",
            "PYTHONIOENCODING": "utf-8",
            "OPENBLAS_NUM_THREADS": "1",
            "OMP_NUM_THREADS": "1",
            "MKL_NUM_THREADS": "1",
        }
    )
    docker_image: str = "python:3.11-slim"

    def __post_init__(self) -> None:
        def bad(name: str, value: object, want: str) -> None:
            raise ValueError(f"SandboxConfig.{name}={value!r}: {want}")

        if self.isolation not in ISOLATIONS:
            bad("isolation", self.isolation, f"must be one of {ISOLATIONS}")
        if not isinstance(self.workers, int) or self.workers < 1:
            bad("workers", self.workers, "must be an int >= 1")
        if not self.timeout_s > 0:
            bad("timeout_s", self.timeout_s, "must be > 0 seconds")
        if not isinstance(self.memory_mb, int) or self.memory_mb < 64:
            bad("memory_mb", self.memory_mb, "must be an int >= 64 (MiB)")
        if not isinstance(self.max_output_bytes, int) or self.max_output_bytes < 16:
            bad("max_output_bytes", self.max_output_bytes, "must be an int >= 16")
        if not isinstance(self.max_file_mb, int) or self.max_file_mb < 1:
            bad("max_file_mb", self.max_file_mb, "must be an int >= 1 (MiB)")
        if not isinstance(self.tmp_size_mb, int) or self.tmp_size_mb < 1:
            bad("tmp_size_mb", self.tmp_size_mb, "must be an int >= 1 (MiB)")
        if not isinstance(self.max_processes, int) or self.max_processes < 2:
            bad("max_processes", self.max_processes, "must be an int >= 2")
        if not isinstance(self.uid_base, int) or not 1000 <= self.uid_base < 2**31 - 1024:
            bad("uid_base", self.uid_base, "must be an int in [1000, 2**31 - 1024)")


@dataclass(frozen=True)
class SandboxResult:
    """Outcome of one sandboxed call.

    Attributes:
        stdout, stderr: captured text (UTF-8, undecodable bytes replaced); together at most
            ``max_output_bytes`` bytes.
        exit_code: process exit status (``-N`` when killed by signal N; ``None`` when the
            worker failed before the code ran).
        status: one of ``ok``, ``error``, ``timeout``, ``cpu_limit``, ``memory_limit``,
            ``output_limit``, ``file_size_limit``, ``signal``, ``sandbox_error``.
        reason: human-readable explanation (``None`` when ``status == "ok"``).
        truncated: whether output was cut at ``max_output_bytes``.
        duration_s: wall time of the call inside the sandbox, seconds.
        cpu_s: user + system CPU time of the call's process, seconds.
        max_rss_kb: peak resident set size of the call's process, KiB.
        wall_s: wall time seen by the caller including IPC, seconds.
    """

    stdout: str
    stderr: str
    exit_code: int | None
    status: str
    reason: str | None
    truncated: bool = False
    duration_s: float = 0.0
    cpu_s: float = 0.0
    max_rss_kb: int = 0
    wall_s: float = 0.0

    @property
    def ok(self) -> bool:
        """True when the code exited with status 0 inside all limits."""
        return self.status == STATUS_OK
