"""The hash manifest of a pulled model directory: written at pull time, checked at every use.

``copc_manifest.json`` in the directory records, for every other file in it (recursively), its size
and SHA-256, every sub-directory, plus where the model came from. Symlinks are never followed and
never accepted (a symlinked folder would bring in files the manifest never saw).
:func:`manifest_problem` compares the directory with it.

Cost and the fast path: hashing the 538 MB of SmolLM2-135M takes ~0.9 s on this machine (warm page
cache), paid on every ``copc train`` / ``copc eval`` / config load that names the model. The
manifest therefore also records each file's ``(inode, size, mtime_ns, ctime_ns)`` as the pull left
it. When all of them still match, the content is taken as unchanged without reading it: any write
through the file system updates ``mtime`` and ``ctime``, and ``ctime`` cannot be set back by a
user (``touch``/``os.utime`` set ``mtime`` only, and themselves bump ``ctime``). When any of them
differs (a copied, restored, touched or edited directory), every file is hashed in full, and only a
hash mismatch is an error. So the fast path never changes a verdict, only its cost. What neither
path defends against is someone who can also rewrite the manifest: it lives beside the files;
the wheel itself is pinned by SHA-256 in the registry and checked by pip.
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
from collections.abc import Mapping
from pathlib import Path
from typing import Any

#: The manifest's file name inside a pulled model directory.
MANIFEST = "copc_manifest.json"
_CHUNK = 1 << 20


def sha256_file(path: str | Path) -> str:
    """Hex SHA-256 of a file's bytes (read in 1 MiB chunks)."""
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(_CHUNK), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _entries(directory: Path) -> tuple[list[str], list[str], list[str]]:
    """``(files, dirs, odd)``: relative POSIX paths below ``directory`` of its regular files (the
    manifest excluded), of its directories, and of every symlink or other non-regular entry (never
    followed: a symlinked folder is one odd entry, not a directory to walk); each sorted."""
    files, dirs, odd = [], [], []
    for root, subdirs, names in os.walk(directory):
        rel_root = Path(root).relative_to(directory)
        for name in subdirs:
            full = Path(root, name)
            (odd if full.is_symlink() else dirs).append((rel_root / name).as_posix())
        for name in names:
            rel = (rel_root / name).as_posix()
            if rel != MANIFEST:
                (files if stat.S_ISREG(os.lstat(Path(root, name)).st_mode) else odd).append(rel)
    return sorted(files), sorted(dirs), sorted(odd)


def _expected_dirs(manifest: Mapping[str, Any]) -> set[str]:
    """The directories a pulled model holds: the manifest's ``dirs`` or, for a manifest written before
    it recorded them, the parent directories of its files."""
    if isinstance(manifest.get("dirs"), list):
        return set(manifest["dirs"])
    return {p.as_posix() for name in manifest["files"] for p in Path(name).parents if p != Path(".")}


def _stat_key(path: Path) -> list[int]:
    st = path.stat()
    return [st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns]


def write_manifest(directory: str | Path, info: Mapping[str, Any]) -> dict[str, Any]:
    """Hash every file of ``directory`` and write ``directory/copc_manifest.json``.

    Call it on the finished directory (nothing may be written there afterwards; renaming the
    directory itself is fine: it changes no file's inode or times).

    Args:
        directory: the converted model directory.
        info: provenance recorded as is (model name, wheel, versions, the logits check).

    Returns:
        The manifest: ``{**info, "dirs": [every sub-directory], "files": {path: {"size", "sha256"}},
        "stat": {path: [ino, size, mtime_ns, ctime_ns]}}``.

    Raises:
        ValueError: ``directory`` holds a symlink or special file (named).
    """
    d = Path(directory)
    names, dirs, odd = _entries(d)
    if odd:
        raise ValueError(f"{d / odd[0]}: a symlink or special file; a pulled model directory holds none")
    manifest = {**info, "dirs": dirs,
                "files": {n: {"size": (d / n).stat().st_size, "sha256": sha256_file(d / n)} for n in names},
                "stat": {n: _stat_key(d / n) for n in names}}
    tmp = d / f".{MANIFEST}.tmp"
    tmp.write_text(json.dumps(manifest, indent=1, sort_keys=True))
    os.replace(tmp, d / MANIFEST)
    return manifest


def read_manifest(directory: str | Path) -> dict[str, Any] | None:
    """The manifest of ``directory``, or None when it has none.

    Raises:
        ValueError: the manifest is not valid JSON with a ``files`` mapping.
    """
    path = Path(directory) / MANIFEST
    if not path.is_file():
        return None
    try:
        manifest = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: unreadable manifest ({e})") from None
    if not isinstance(manifest, dict) or not isinstance(manifest.get("files"), dict):
        raise ValueError(f"{path}: unreadable manifest (no 'files' mapping)")
    return manifest


def manifest_problem(directory: str | Path, *, full: bool = False) -> str | None:
    """What differs between ``directory`` and its manifest, or None when nothing does.

    Args:
        directory: a directory with a ``copc_manifest.json``.
        full: hash every file even when the recorded stat keys all match (see the module docstring).

    Returns:
        None, or one line naming the first offending path: a symlink or special file anywhere below
        (never followed: a symlinked folder could otherwise bring in files the manifest never saw, e.g.
        ``additional_chat_templates/`` replacing the chat template), a directory added or missing, a
        file missing, not in the manifest (an added file), a different size, or a different SHA-256
        (both hashes given).
    """
    d = Path(directory)
    try:
        manifest = read_manifest(d)
    except ValueError as e:
        return str(e)
    if manifest is None:
        return f"{d / MANIFEST}: missing (not a directory written by copc model pull)"
    files: dict[str, dict] = manifest["files"]
    present, dirs, odd = _entries(d)
    if odd:
        target = f" (to {os.readlink(d / odd[0])!r})" if (d / odd[0]).is_symlink() else ""
        return f"{d / odd[0]}: a symlink or special file{target}; refused (a pulled model holds none)"
    want_dirs = _expected_dirs(manifest)
    if added_dirs := sorted(set(dirs) - want_dirs):
        return f"{d / added_dirs[0]}: a directory not in the manifest (added after the pull)"
    if missing_dirs := sorted(want_dirs - set(dirs)):
        return f"{d / missing_dirs[0]}: missing directory (the manifest lists it)"
    missing, added = sorted(set(files) - set(present)), sorted(set(present) - set(files))
    if missing:
        return f"{d / missing[0]}: missing (the manifest lists it)"
    if added:
        return f"{d / added[0]}: not in the manifest (added after the pull)"
    stats = manifest.get("stat") or {}
    if not full and all(stats.get(n) == _stat_key(d / n) for n in present):
        return None
    for name in present:
        want = files[name]
        size = (d / name).stat().st_size
        if size != want.get("size"):
            return f"{d / name}: {size} bytes, {want.get('size')} recorded at pull time"
        got = sha256_file(d / name)
        if got != want.get("sha256"):
            return f"{d / name}: sha256 {got[:16]}…, {str(want.get('sha256'))[:16]}… recorded at pull time"
    return None
