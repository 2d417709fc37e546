"""One writer per run directory: an exclusive ``fcntl.flock`` on ``<dir>/.copc.lock``."""

from __future__ import annotations

import fcntl
import os
from pathlib import Path
from typing import IO

from ..errors import ConfigError

LOCK_FILE = ".copc.lock"


def lock_output_dir(path: str | Path, key: str = "output_dir") -> IO[str]:
    """Take the exclusive lock of the run directory ``path`` (created if missing) for this process.

    The lock is held while the returned file stays open (close it, or let the process end: the
    kernel releases a ``flock`` with its last descriptor, also after a kill -9). The holder's pid is
    written into the lock file.

    Raises:
        ConfigError: another process holds it; one line naming ``key``, the directory and its pid.
    """
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    fh = open(path / LOCK_FILE, "a+")  # noqa: SIM115 - kept open: it is the lock
    try:
        fcntl.flock(fh.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        fh.seek(0)
        holder = fh.read().strip() or "unknown"
        fh.close()
        raise ConfigError(f"{key}={str(path)!r}: another copc process (pid {holder}) is writing there; "
                          "wait for it or choose another directory") from None
    fh.seek(0)
    fh.truncate()
    fh.write(f"{os.getpid()}\n")
    fh.flush()
    return fh
