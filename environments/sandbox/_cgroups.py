"""The sandbox worker's handles on its slot's cgroups (stdlib only; runs inside the sandbox)."""

from __future__ import annotations

import contextlib
import os

import _confine
import _wire

#: cgroup v1's separate limit of the TCP socket buffers (unaccounted until set): ``memory_mb`` too.
TCP_LIMIT = "memory.kmem.tcp.limit_in_bytes"


class Cgroups:
    """The worker's handles on its slot's cgroups (opened once at start-up, after which the
    cgroup mounts are detached, so no call's mount namespace contains them): moving a call
    in, its memory limit and its OOM notifications."""

    def __init__(self, opts: _wire.Options) -> None:
        self.limit: int | None = None
        self.efd = None
        self.fds: dict[str, int] = {}
        self.procs = []
        self.controllers = [ctl for ctl, path in (("memory", opts.cg_memory), ("pids", opts.cg_pids),
                                                  ("cpu", opts.cg_cpu)) if path is not None]
        for path in (opts.cg_memory, opts.cg_pids, opts.cg_cpu):
            if path is not None:
                self.procs.append(os.open(os.path.join(path, "cgroup.procs"), os.O_WRONLY))
        if opts.cg_memory is not None:
            for name in ("memory.limit_in_bytes", "memory.memsw.limit_in_bytes", TCP_LIMIT):
                with contextlib.suppress(FileNotFoundError):  # memsw: only with swap accounting
                    self.fds[name] = os.open(os.path.join(opts.cg_memory, name), os.O_WRONLY)
            self.efd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
            oom_fd = os.open(os.path.join(opts.cg_memory, "memory.oom_control"), os.O_RDONLY)
            with open(os.path.join(opts.cg_memory, "cgroup.event_control"), "w") as f:
                f.write(f"{self.efd} {oom_fd}")
        for path in (opts.cg_memory, opts.cg_pids, opts.cg_cpu):
            if path is not None:
                _confine.umount(path)

    def enter(self, pid: int) -> None:
        """Move process ``pid`` (a new call, itself) into the slot's cgroups (memory, pids,
        cpu where the pool made them)."""
        for fd in self.procs:
            os.pwrite(fd, str(pid).encode(), 0)

    def missing(self, pid: int) -> list[str]:
        """The slot controllers call process ``pid`` is not in (read from ``/proc/<pid>/cgroup``
        as the fork server sees it; the call itself sees ``/`` in its cgroup namespace)."""
        if not self.controllers:
            return []
        try:
            with open(f"/proc/{pid}/cgroup") as f:
                lines = [ln.rstrip("\n").split(":", 2) for ln in f]
        except OSError:
            return list(self.controllers)
        inside = {ctl for _, names, path in lines if "/slot-" in path for ctl in names.split(",")}
        return [ctl for ctl in self.controllers if ctl not in inside]

    def set_limit(self, memory_mb: int) -> None:
        """Limit the call's memory (all processes, tmpfs, shared memory, kernel objects) to
        ``memory_mb``, and its TCP socket buffers (charged apart by cgroup v1) to as much."""
        new = memory_mb * 1024 * 1024
        if not self.fds or new == self.limit:
            return
        order = ["memory.limit_in_bytes"]
        if "memory.memsw.limit_in_bytes" in self.fds:  # memory+swap >= memory at every step
            grow = self.limit is not None and new > self.limit  # (unset: unlimited)
            memsw = "memory.memsw.limit_in_bytes"
            order = [memsw, *order] if grow else [*order, memsw]
        if TCP_LIMIT in self.fds:  # cgroup v1 accounts socket buffers apart, only once limited
            order.append(TCP_LIMIT)
        for name in order:
            os.pwrite(self.fds[name], str(new).encode(), 0)
        self.limit = new

    def oom_events(self) -> int:
        """OOM events in the call's memory cgroup since the last read."""
        if self.efd is None:
            return 0
        try:
            return os.eventfd_read(self.efd)
        except BlockingIOError:
            return 0
