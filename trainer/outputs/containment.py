"""Containment of a checkpoint's ``COMPLETE`` marker: every path it names stays inside the checkpoint.

A marker is data from disk: a crafted one could point loads at ``../../x.pt``, an absolute shards
directory or a symlink to a file elsewhere. :func:`marker_escape` refuses each of those by name.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path


def _outside(path: Path, rel: str) -> str | None:
    """Why the marker path ``rel`` does not name something inside the checkpoint ``path``, or None:
    absolute, a ``..`` or empty component, or a symlink on the way (checked with ``lstat``, so a
    symlink to a file or directory outside is refused, as is one to a sibling inside)."""
    parts = rel.split("/")
    if not rel or rel.startswith("/") or "\0" in rel or any(p in ("", ".", "..") for p in parts):
        return "is not a relative path inside the checkpoint (absolute, '..' or empty part)"
    cur = path
    for part in parts:
        cur = cur / part
        try:
            if stat.S_ISLNK(os.lstat(cur).st_mode):
                return f"is a symlink ({cur.relative_to(path).as_posix()} -> {os.readlink(cur)!r}); refused"
        except OSError:  # missing, or under a file: reported as missing by the size check
            return None
    return None


def marker_escape(path: Path, meta: dict, marker: str = "COMPLETE") -> str | None:
    """One line naming the first path of the marker ``meta`` (``keys``, ``dirs``, ``files``) that does
    not resolve inside the checkpoint ``path`` (:func:`_outside`), or a symlink anywhere under a
    ``dirs`` directory; None when every one stays inside.

    Args:
        path: the checkpoint directory. meta: its parsed, well-formed marker. marker: the marker's
            file name (for the message).
    """
    listed = [*meta.get("keys", {}).values(), *meta.get("dirs", {}).values(), *meta.get("files", {})]
    for rel in listed:
        if (why := _outside(path, rel)) is not None:
            return f"{path}: {marker} names {rel!r}, which {why}"
    for rel in meta.get("dirs", {}).values():
        for root, dirs, names in os.walk(path / rel):
            for name in [*dirs, *names]:
                if os.path.islink(os.path.join(root, name)):
                    inner = Path(root, name).relative_to(path).as_posix()
                    return f"{path}: {inner} is a symlink (to {os.readlink(Path(root, name))!r}); refused"
    return None
