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
        for path in (opts.cg_memory, opts.cg_pids):
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
        for path in (opts.cg_memory, opts.cg_pids):
            if path is not None:
                _confine.umount(path)

    def enter(self, pid: int) -> None:
        """Move process ``pid`` (a new call) into the slot's cgroups."""
        for fd in self.procs:
            os.pwrite(fd, str(pid).encode(), 0)

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
