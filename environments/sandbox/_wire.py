"""The sandbox worker's interface with the pool (stdlib only; runs inside the sandbox).

:class:`Options` reads the worker's command line (see ``_worker.main``); :func:`recv` /
:func:`send` carry the messages on its pipes: each a 4-byte big-endian length followed by that
many bytes of UTF-8 JSON.
"""

from __future__ import annotations

import json
import os
import struct

_HEADER = struct.Struct(">I")
#: call process -> server, after its ``R`` (set up): its pid
READY_PID = struct.Struct("=i")
#: zygote -> server: ``X`` + pid, wait status, user / system CPU seconds, peak RSS in KiB
EXIT_MSG = struct.Struct("=ciiddq")


def read_exact(fd: int, n: int) -> bytes:
    """Read exactly ``n`` bytes from ``fd``.

    Raises:
        EOFError: the pipe closed first.
    """
    buf = bytearray()
    while len(buf) < n:
        chunk = os.read(fd, n - len(buf))
        if not chunk:
            raise EOFError
        buf += chunk
    return bytes(buf)


def recv(fd: int) -> dict:
    """Read one length-prefixed JSON message from ``fd`` (``EOFError`` when the pipe closed)."""
    (n,) = _HEADER.unpack(read_exact(fd, 4))
    return json.loads(read_exact(fd, n))


def send(fd: int, msg: dict) -> None:
    """Write ``msg`` to ``fd`` as one length-prefixed JSON message."""
    data = json.dumps(msg).encode()
    write_all(fd, _HEADER.pack(len(data)) + data)


def write_all(fd: int, data: bytes) -> None:
    """Write all of ``data`` to ``fd`` (short writes continued)."""
    view = memoryview(data)
    while view:
        n = os.write(fd, view)
        view = view[n:]


class Options:
    """The worker's command-line settings (see ``_worker.main``)."""

    def __init__(self, args: list[str]) -> None:
        def value(flag: str, n: int = 1) -> list[str] | None:
            if flag not in args:
                return None
            i = args.index(flag)
            return args[i + 1:i + 1 + n]

        drop = value("--drop-uid", 2)
        self.drop = (int(drop[0]), int(drop[1])) if drop else None
        self.in_pid_ns = "--pid-ns" in args
        self.namespaces = "--namespaces" in args
        self.tmp_root = (value("--tmp-root") or ["/tmp"])[0]
        self.tmp_bytes = int((value("--tmp-bytes") or [str(64 << 20)])[0])
        self.cg_memory = (value("--cgroup-memory") or [None])[0]
        self.cg_pids = (value("--cgroup-pids") or [None])[0]
        self.cg_cpu = (value("--cgroup-cpu") or [None])[0]
        self.proc = (value("--proc-scratch") or [None])[0]
        self.preload = [m for m in (value("--preload") or [""])[0].split(",") if m]
        self.keep = tuple(p for p in (value("--keep") or [""])[0].split(",") if p)
