"""One writer per run directory: an exclusive ``fcntl.flock`` on ``<dir>/.copc.lock``.

The lock file is opened with ``O_NOFOLLOW`` and must be a regular file with one name: a
``.copc.lock`` that is a symlink or a hard link (e.g. planted in a shared run directory, naming a
file of the user's) is refused before anything is written, so taking the lock never truncates
another file.
"""

from __future__ import annotations

import errno
import fcntl
import os
import stat
from pathlib import Path
from typing import IO

from ..errors import ConfigError

LOCK_FILE = ".copc.lock"


def _open_lock_file(path: Path, key: str) -> IO[str]:
    """``path`` opened read/write (created 0644 if missing) without following a symlink.

    Raises:
        ConfigError: ``path`` is a symlink, not a regular file, or has other hard links (one line
            naming ``key`` and it).
    """
    flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
    try:
        fd = os.open(path, flags, 0o644)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise ConfigError(f"{key}={str(path.parent)!r}: its lock file {LOCK_FILE} is a symlink "
                              f"(to {os.readlink(path)!r}); refused, remove it") from None
        raise
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise ConfigError(f"{key}={str(path.parent)!r}: its lock file {LOCK_FILE} is not a regular file; "
                          "refused, remove it")
    if st.st_nlink != 1:  # a hard link to another file (truncated and overwritten with our pid)
        os.close(fd)
        raise ConfigError(f"{key}={str(path.parent)!r}: its lock file {LOCK_FILE} has {st.st_nlink} "
                          "hard links (another file's name too); refused, remove it")
    os.set_blocking(fd, True)
    return os.fdopen(fd, "r+")


def lock_output_dir(path: str | Path, key: str = "output_dir") -> IO[str]:
    """Take the exclusive lock of the run directory ``path`` (created if missing) for this process.

    The lock is held while the returned file stays open (close it, or let the process end: the
    kernel releases a ``flock`` with its last descriptor, also after a kill -9). The holder's pid is
    written into the lock file (only once the lock is held).

    Raises:
        ConfigError: another process holds it (one line naming ``key``, the directory and its pid),
            or ``<path>/.copc.lock`` is a symlink, not a regular file or hard-linked elsewhere
            (nothing is written then).
    """
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    fh = _open_lock_file(path / LOCK_FILE, key)
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
