"""Host resources of one sandbox pool: its own uids and its per-worker cgroups.

* :class:`UidClaim` — uids no other pool on this host uses at the same time (an exclusive
  ``flock`` per uid under ``/run/copc-sandbox``, released when the pool's process ends), so
  ``RLIMIT_NPROC`` counts only this pool's worker;
* :class:`PoolCgroups` — one cgroup v1 ``memory`` and ``pids`` directory per worker slot
  under this process's own cgroups: ``memory_mb`` then bounds all processes, tmpfs pages,
  shared memory and kernel objects of a call together, and ``max_processes`` is the call's
  ``pids.max``. Where the host offers no writable v1 ``memory`` + ``pids`` hierarchy (e.g. a
  cgroup2-only host) ``mode`` is ``"rlimit"`` and ``why`` says why (the documented fallback:
  per-process RLIMIT_AS and size-limited tmpfs). Where a writable v1 ``cpu`` hierarchy is
  mounted as well, each slot also gets a ``cpu`` cgroup with ``cpu.shares`` = :data:`CPU_SHARES`
  (``cpu_mode == "cgroup-v1"``; the pool's own directory gets ``CPU_SHARES`` times its slots):
  the kernel then divides CPU time between slots (of this and every other pool) as groups,
  however many processes a call starts, so one call cannot slow another pool's call by running
  many processes, while each slot weighs as much as one process did before. Otherwise
  ``cpu_mode`` is ``"none"`` and ``cpu_why`` says why (processes then compete one by one).
"""

from __future__ import annotations

import contextlib
import fcntl
import itertools
import os

LOCK_DIR = "/run/copc-sandbox"
UID_SPAN = 4096  # uids tried from SandboxConfig.uid_base on
CPU_SHARES = 1024  # every slot's weight (the kernel's default for one task or group)
_COUNTER = itertools.count()


def _uids_in_use() -> set[int]:
    used: set[int] = set()
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        with contextlib.suppress(OSError):
            used.add(os.stat(f"/proc/{pid}").st_uid)
    return used


class UidClaim:
    """Claim ``n`` uids from ``[base, base + UID_SPAN)`` for this pool (root only).

    Raises:
        RuntimeError: fewer than ``n`` uids are free in the range.
    """

    def __init__(self, base: int, n: int) -> None:
        os.makedirs(LOCK_DIR, mode=0o700, exist_ok=True)
        used = _uids_in_use()
        self.uids: list[int] = []
        self._fds: list[int] = []
        for uid in range(base, base + UID_SPAN):
            if len(self.uids) == n:
                break
            if uid in used:
                continue
            fd = os.open(os.path.join(LOCK_DIR, f"uid-{uid}.lock"), os.O_RDWR | os.O_CREAT
                         | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                os.close(fd)
                continue
            self.uids.append(uid)
            self._fds.append(fd)
        if len(self.uids) < n:
            self.release()
            raise RuntimeError(f"no {n} free sandbox uids in [{base}, {base + UID_SPAN})")

    def release(self) -> None:
        """Give the uids back (idempotent)."""
        for fd in self._fds:
            with contextlib.suppress(OSError):
                os.close(fd)
        self._fds.clear()


def _v1_dir(controller: str) -> str | None:
    """This process's cgroup directory in the v1 hierarchy holding ``controller``."""
    mount = None
    with open("/proc/self/mounts") as f:
        for line in f:
            _dev, target, fstype, options = line.split()[:4]
            if fstype == "cgroup" and controller in options.split(","):
                mount = target
    if mount is None:
        return None
    with open("/proc/self/cgroup") as f:
        for line in f:
            _, names, path = line.rstrip("\n").split(":", 2)
            if controller in names.split(","):
                return os.path.join(mount, path.lstrip("/"))
    return None


class PoolCgroups:
    """Per-slot cgroup v1 ``memory``, ``pids`` and (where mounted) ``cpu`` directories of one
    pool (see module doc); ``mode``/``why`` for memory + pids, ``cpu_mode``/``cpu_why`` for cpu.

    Args:
        max_processes: every slot's ``pids.max``.
        workers: the pool's slots (its ``cpu`` directory weighs ``CPU_SHARES`` per slot).
    """

    def __init__(self, max_processes: int, workers: int = 1) -> None:
        self.max_processes = max_processes
        self.mode, self.why = "rlimit", ""
        self.cpu_mode, self.cpu_why = "none", "no cgroup v1 'memory' + 'pids' hierarchy"
        self.base: dict[str, str] = {}
        if os.geteuid() != 0:
            self.why = "not root: cgroups cannot be created"
            return
        name = f"copc-sandbox-{os.getpid()}-{next(_COUNTER)}"
        for ctl in ("memory", "pids"):
            path, self.why = _new_group(ctl, name)
            if path is None:
                break
            self.base[ctl] = path
        if self.why:
            self.close()
            return
        self.mode = "cgroup-v1"
        self.cpu_mode = "none"
        path, self.cpu_why = _new_group("cpu", name)
        if path is None:
            return
        self.base["cpu"] = path
        try:  # the pool weighs as much as its slots would as single processes, together
            with open(os.path.join(self.base["cpu"], "cpu.shares"), "w") as f:
                f.write(str(CPU_SHARES * workers))
        except OSError as e:
            self.cpu_why = f"cannot set cpu.shares of {self.base['cpu']}: {e}"
            _rmtree_cgroup(self.base.pop("cpu"))
            return
        self.cpu_mode = "cgroup-v1"

    def slot(self, slot: int) -> dict[str, str]:
        """Fresh (empty) memory, pids (and cpu) cgroups for worker ``slot``: ``{controller: path}``.

        Raises:
            OSError: a cgroup could not be created or configured.
        """
        if self.mode != "cgroup-v1":
            return {}
        dirs = {}
        for ctl, base in self.base.items():
            path = os.path.join(base, f"slot-{slot}")
            with contextlib.suppress(OSError):
                os.rmdir(path)  # the replaced worker's (its processes are dead)
            os.makedirs(path, exist_ok=True)
            dirs[ctl] = path
        with open(os.path.join(dirs["pids"], "pids.max"), "w") as f:
            f.write(str(self.max_processes))
        if "cpu" in dirs:
            with open(os.path.join(dirs["cpu"], "cpu.shares"), "w") as f:
                f.write(str(CPU_SHARES))
        return dirs

    def close(self) -> None:
        """Remove the pool's cgroups (idempotent; the workers must be dead)."""
        for base in self.base.values():
            _rmtree_cgroup(base)
        self.base.clear()


def _rmtree_cgroup(path: str) -> None:
    with contextlib.suppress(OSError):
        for entry in os.listdir(path):
            sub = os.path.join(path, entry)
            if os.path.isdir(sub):
                with contextlib.suppress(OSError):
                    os.rmdir(sub)
    with contextlib.suppress(OSError):
        os.rmdir(path)


def _remove_stale(parent: str) -> None:
    """Remove pool cgroups left by processes that no longer exist."""
    with contextlib.suppress(OSError):
        for entry in os.listdir(parent):
            if not entry.startswith("copc-sandbox-"):
                continue
            pid = entry.split("-")[2]
            if pid.isdigit() and not os.path.exists(f"/proc/{pid}"):
                _rmtree_cgroup(os.path.join(parent, entry))


def _new_group(ctl: str, name: str) -> tuple[str | None, str]:
    """``(path, "")`` of a new cgroup ``name`` in the v1 ``ctl`` hierarchy (stale groups of dead
    pools removed first), or ``(None, why)`` when there is no such hierarchy or it cannot be made."""
    parent = _v1_dir(ctl)
    if parent is None:
        return None, f"no cgroup v1 '{ctl}' hierarchy mounted"
    _remove_stale(parent)
    try:
        os.mkdir(os.path.join(parent, name), 0o755)
    except OSError as e:
        return None, f"cannot create a '{ctl}' cgroup under {parent}: {e}"
    return os.path.join(parent, name), ""
