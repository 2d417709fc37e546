"""Atomic, crash-safe training checkpoints and RNG-state capture.

Layout of a checkpoint directory (``CheckpointManager.directory``)::

    step_00000012/           a complete checkpoint (step 12)
        model.pt             one ``torch.save`` file per top-level key of the state
        optimizer.pt
        data_cursor.pt
        learner_shards/      a directory value (:class:`DirectoryState`), e.g. sharded DCP files
        ...
        COMPLETE             the marker, written last: JSON {"step": 12, "keys": {...}, "time": unix_s,
                             "files": {relative path: {"size": bytes, "sha256": hex}}}
    .tmp-step_00000013-...   a save in progress, or left by a crash (ignored, removed by the next save)

Why one file per key: a multi-GB model state and a 100-byte data cursor do not share
one pickle, a key can be loaded on its own (``load(keys=...)``), and the marker lists
every file so a directory with a missing file is detected.

Atomicity (the classic write-then-rename protocol): every file is written into a
temporary sibling directory and ``fsync``-ed, the ``COMPLETE`` marker is written and
``fsync``-ed last, the temporary directory is ``fsync``-ed, then ``os.rename``-d to
``step_XXXXXXXX`` (atomic within one POSIX filesystem) and the parent directory is
``fsync``-ed. A process killed at any point (SIGKILL, power loss) therefore leaves
either the complete new checkpoint or only a ``.tmp-*`` directory; ``latest()``
only ever returns directories that carry the marker.

Integrity: the marker records the size and SHA-256 of every file of the checkpoint (those of
:class:`DirectoryState` directories included). :meth:`CheckpointManager.problem` checks them;
:meth:`CheckpointManager.load` refuses a torn checkpoint (:class:`CheckpointError` naming the
file), and :meth:`CheckpointManager.load_latest` skips one with a one-line warning and loads the
previous intact checkpoint. Markers of older checkpoints (no ``files``) are checked for
presence only.

Containment: every path the marker names (``keys``, ``dirs``, ``files``) must be relative, without
``..``, and reach its file through no symlink; no symlink may sit anywhere under a ``dirs``
directory. A crafted marker pointing loads at ``../../x.pt`` or at an absolute shards directory is
refused by :meth:`CheckpointManager.problem` (one line naming the path) before anything is read.

Loading uses ``torch.load(..., weights_only=True)``: tensors, containers and plain python
values only, never arbitrary objects (the states hold data cursors, prompt-id lists, metrics
and RNG states, all stored as such plain values; :func:`rng_state` keeps numpy's state as a
tensor). Checkpoints written before that hold numpy arrays, allowed through a numpy-only
allowlist. Sharded learner state (DCP) is read by the learner through
:mod:`trainer.learner.distributed.safe_dcp` (its metadata pickle through an allowlist too).
Tensors are loaded onto the CPU (``map_location="cpu"``); ``Optimizer.load_state_dict``
and ``Module.load_state_dict`` move them to the parameters' device.

A value may be a :class:`DirectoryState`: instead of ``torch.save`` its ``write(path)`` fills
the directory ``<key>/`` inside the temporary checkpoint (every file in it is ``fsync``-ed
before the marker), so sharded learner state written by several rank processes is part of
the same atomic rename. ``load`` returns that key as the ``Path`` of the directory.

Single-writer assumption: one process saves into a given directory at a time.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import random
import re
import shutil
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .containment import marker_escape

log = logging.getLogger(__name__)

MARKER = "COMPLETE"
_PREFIX = "step_"
_TMP_PREFIX = ".tmp-"
_TRASH_PREFIX = ".trash-"
_STEP_RE = re.compile(r"^step_(\d{8,})$")
_KEY_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]*$")


class CheckpointError(ValueError):
    """A checkpoint that cannot be used: torn (a file's size or hash differs from the marker's),
    or no intact checkpoint where one was expected; the message names the directory/file."""


@dataclass(frozen=True)
class DirectoryState:
    """A checkpoint value stored as a directory: ``write(path)`` fills the new directory ``path``
    (e.g. every learner rank writes its shard there). Loading gives back the directory's ``Path``.

    Attributes:
        write: ``write(path: Path) -> None``; ``path`` exists and is empty when it is called.
    """

    write: Callable[[Path], None]


def _fsync_tree(path: Path) -> None:
    """fsync every file and directory under ``path`` (a :class:`DirectoryState`'s output)."""
    for root, _dirs, files in os.walk(path):
        for name in files:
            _fsync_file(Path(root) / name)
        _fsync_dir(Path(root))


def _sha256(path: Path) -> str:
    """Hex SHA-256 of a file's bytes (read in 1 MiB blocks)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _manifest(root: Path) -> dict[str, dict]:
    """``{relative path: {"size", "sha256"}}`` of every file under ``root`` (the marker excluded)."""
    out = {}
    for dirpath, _dirs, names in os.walk(root):
        for name in names:
            f = Path(dirpath) / name
            rel = f.relative_to(root).as_posix()
            if rel != MARKER:
                out[rel] = {"size": f.stat().st_size, "sha256": _sha256(f)}
    return out


def _malformed(meta: Any) -> str | None:
    """What is wrong with the shape of a parsed ``COMPLETE`` marker, or None: a JSON object with
    ``keys`` (required) and optional ``dirs`` mapping names to relative paths, and optional ``files``
    mapping relative paths to ``{"size": int, "sha256": str}``."""
    if not isinstance(meta, dict):
        return f"is {type(meta).__name__}, not a JSON object"
    if "keys" not in meta:
        return "has no field 'keys'"
    for field in ("keys", "dirs"):
        value = meta.get(field, {})
        if not isinstance(value, dict) or not all(isinstance(v, str) for v in value.values()):
            return f"field {field!r} is not an object of file names"
    files = meta.get("files", {})
    if not isinstance(files, dict) or not all(
            isinstance(r, dict) and isinstance(r.get("size"), int) and isinstance(r.get("sha256"), str)
            for r in files.values()):
        return "field 'files' is not an object of {size, sha256} records"
    return None


def _missing_or_resized(path: Path, meta: dict) -> str | None:
    """The first file the marker ``meta`` lists that is absent under ``path`` or has another size."""
    listed = {**{n: {} for n in meta.get("keys", {}).values()}, **meta.get("files", {})}
    for rel in sorted(listed):
        f = path / rel
        if not f.is_file() or ("size" in listed[rel] and f.stat().st_size != listed[rel]["size"]):
            return rel
    return None


def _legacy_numpy_globals() -> list:
    """The numpy reconstructors ``torch.load(weights_only=True)`` needs for checkpoints written
    before :func:`rng_state` stored numpy's state as a tensor (arrays of plain dtypes only)."""
    return [np._core.multiarray._reconstruct, np.ndarray, np.dtype, np.dtypes.UInt32DType]


def _load_file(path: Path) -> Any:
    """``torch.load(path, weights_only=True)`` on the CPU (numpy arrays allowed for old files)."""
    with torch.serialization.safe_globals(_legacy_numpy_globals()):
        return torch.load(path, map_location="cpu", weights_only=True)


def _fsync_file(path: Path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    """fsync a directory so that renames/creations inside it are durable (POSIX)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class CheckpointManager:
    """Saves, finds and loads ``step_XXXXXXXX`` checkpoints in one directory.

    Args:
        directory: where checkpoints live; created if missing.
        keep_last: how many complete checkpoints to keep (>= 1); older ones are deleted
            after each successful save.

    Raises:
        ValueError: if ``keep_last`` is not a positive int.
    """

    def __init__(self, directory: str | Path, keep_last: int = 2) -> None:
        if isinstance(keep_last, bool) or not isinstance(keep_last, int) or keep_last < 1:
            raise ValueError(f"keep_last must be an int >= 1, got {keep_last!r}")
        self.directory = Path(directory)
        self.keep_last = keep_last
        self.directory.mkdir(parents=True, exist_ok=True)

    # ----------------------------------------------------------------- queries
    @staticmethod
    def step_of(path: str | Path) -> int:
        """The step number encoded in a checkpoint directory name ``step_XXXXXXXX``.

        Raises:
            ValueError: if the name does not match.
        """
        m = _STEP_RE.match(Path(path).name)
        if m is None:
            raise ValueError(f"not a checkpoint directory name (expected step_XXXXXXXX): {str(path)!r}")
        return int(m.group(1))

    @staticmethod
    def is_complete(path: str | Path) -> bool:
        """True iff ``path`` is a directory holding the ``COMPLETE`` marker and every file it lists."""
        path = Path(path)
        marker = path / MARKER
        if not marker.is_file():
            return False
        try:
            meta = json.loads(marker.read_text())
        except (OSError, ValueError):
            return False
        if _malformed(meta) is not None or marker_escape(path, meta, MARKER) is not None:
            return False
        files, dirs, sizes = meta.get("keys", {}), meta.get("dirs", {}), meta.get("files", {})
        return (all((path / name).is_file() for name in files.values())
                and all((path / name).is_dir() for name in dirs.values())
                and all((path / rel).is_file() and (path / rel).stat().st_size == rec["size"]
                        for rel, rec in sizes.items()))

    @staticmethod
    def problem(path: str | Path) -> str | None:
        """Why ``path`` is not an intact checkpoint, or None: no marker, a marker path that leaves the
        checkpoint (absolute, ``..``, a symlink; see the module docstring), a listed file missing, or
        a file whose size or SHA-256 differs from the marker's (reads every file once).

        Returns:
            One line naming the checkpoint and the first bad file, or None if intact.
        """
        path = Path(path)
        try:
            meta = json.loads((path / MARKER).read_text())
        except (OSError, ValueError) as e:
            return f"{path}: no readable {MARKER} marker ({type(e).__name__})"
        if (bad := _malformed(meta)) is not None:
            return f"{path}: its {MARKER} marker {bad}"
        if (bad := marker_escape(path, meta, MARKER)) is not None:
            return bad
        if not CheckpointManager.is_complete(path):
            bad = _missing_or_resized(path, meta) or "a listed file or directory"
            return f"{path}: {bad} is missing or has another size than in {MARKER}"
        for rel, rec in sorted(meta.get("files", {}).items()):
            if _sha256(path / rel) != rec.get("sha256"):
                return f"{path}: {rel} does not match the SHA-256 recorded in {MARKER} (torn or altered)"
        return None

    def checkpoints(self) -> list[Path]:
        """All complete checkpoints, oldest first (incomplete and temporary directories are ignored)."""
        found = []
        for p in self.directory.iterdir():
            m = _STEP_RE.match(p.name)
            if m is not None and p.is_dir() and self.is_complete(p):
                found.append((int(m.group(1)), p))
        return [p for _, p in sorted(found)]

    def latest(self) -> Path | None:
        """The newest complete checkpoint directory, or ``None`` if there is none."""
        ckpts = self.checkpoints()
        return ckpts[-1] if ckpts else None

    # -------------------------------------------------------------------- save
    def save(self, step: int, state: dict[str, Any]) -> Path:
        """Write ``state`` atomically as checkpoint ``step``, then prune to ``keep_last``.

        Args:
            step: the training step (int >= 0); names the directory ``step_{step:08d}``.
                Saving a step that already exists replaces it (atomically for readers
                of ``latest()``: the old one stays visible until the new one is complete).
            state: top-level keys become file names ``<key>.pt`` (letters, digits,
                ``_ . -``; not starting with ``.``/``-``); values are anything
                ``torch.save`` can pickle: state dicts, tensors, plain python objects; a
                :class:`DirectoryState` value becomes the directory ``<key>/`` instead.

        Returns:
            The path of the new complete checkpoint directory.

        Raises:
            ValueError: bad ``step`` or key. TypeError: ``state`` is not a dict.
            OSError / pickling errors from ``torch.save`` (or a :class:`DirectoryState`
            writer's errors) propagate; the partial
            temporary directory is then removed and earlier checkpoints are untouched.
        """
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"step must be an int >= 0, got {step!r}")
        if not isinstance(state, dict):
            raise TypeError(f"state must be a dict[str, Any], got {type(state).__name__}")
        for key in state:
            if not isinstance(key, str) or not _KEY_RE.match(key) or key == MARKER:
                raise ValueError(
                    f"state key {key!r} is not a valid checkpoint key "
                    f"(letters, digits, '_', '.', '-'; not {MARKER!r})"
                )

        name = f"{_PREFIX}{step:08d}"
        final = self.directory / name
        tmp = self.directory / f"{_TMP_PREFIX}{name}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        tmp.mkdir()
        trash = None
        try:
            files, dirs = {}, {}
            for key, value in state.items():
                if isinstance(value, DirectoryState):
                    (tmp / key).mkdir()
                    value.write(tmp / key)
                    _fsync_tree(tmp / key)
                    dirs[key] = key
                    continue
                fname = f"{key}.pt"
                torch.save(value, tmp / fname)
                _fsync_file(tmp / fname)
                files[key] = fname
            marker = {"step": step, "keys": files, "time": time.time(), "files": _manifest(tmp)}
            if dirs:
                marker["dirs"] = dirs
            with open(tmp / MARKER, "w") as f:
                json.dump(marker, f)
                f.flush()
                os.fsync(f.fileno())
            _fsync_dir(tmp)
            if final.exists():
                trash = self.directory / f"{_TRASH_PREFIX}{name}-{uuid.uuid4().hex[:8]}"
                os.rename(final, trash)
            os.rename(tmp, final)
            _fsync_dir(self.directory)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            if trash is not None and not final.exists():
                os.rename(trash, final)  # put back the checkpoint we were replacing
            raise
        if trash is not None:
            shutil.rmtree(trash, ignore_errors=True)
        self._cleanup(keep=final)
        return final

    def _cleanup(self, keep: Path) -> None:
        """Prune complete checkpoints beyond ``keep_last``; remove leftovers of crashed saves."""
        for p in self.directory.iterdir():
            if p.name.startswith((_TMP_PREFIX, _TRASH_PREFIX)) and p.is_dir():
                log.info("removing leftover of an interrupted checkpoint save: %s", p)
                shutil.rmtree(p, ignore_errors=True)
        ckpts = self.checkpoints()
        for p in ckpts[: max(0, len(ckpts) - self.keep_last)]:
            if p != keep:
                shutil.rmtree(p, ignore_errors=True)

    # -------------------------------------------------------------------- load
    def load(self, path: str | Path | None = None, keys: list[str] | None = None) -> dict[str, Any] | None:
        """Load a checkpoint's state (the dict given to ``save``), tensors on the CPU.

        Args:
            path: a checkpoint directory; ``None`` means ``latest()``.
            keys: load only these keys (default: all).

        Returns:
            The state dict (a :class:`DirectoryState` key as the ``Path`` of its directory), or
            ``None`` if ``path`` is None and there is no complete checkpoint.

        Raises:
            FileNotFoundError: ``path`` is not a complete checkpoint (missing, or no marker).
            CheckpointError: a listed file is missing or its size or SHA-256 differs from the
                marker's (named).
            KeyError: a requested key is not in the checkpoint.
        """
        if path is None:
            path = self.latest()
            if path is None:
                return None
        path = Path(path)
        if not (path / MARKER).is_file():
            raise FileNotFoundError(f"{str(path)!r} is not a complete checkpoint (no {MARKER} marker)")
        why = self.problem(path)
        if why is not None:
            raise CheckpointError(why)
        meta = json.loads((path / MARKER).read_text())
        files, dirs = meta.get("keys", {}), meta.get("dirs", {})
        wanted = [*files, *dirs] if keys is None else list(keys)
        missing = [k for k in wanted if k not in files and k not in dirs]
        if missing:
            raise KeyError(f"keys {missing} not in checkpoint {str(path)!r} (has {sorted([*files, *dirs])})")
        return {k: path / dirs[k] if k in dirs else _load_file(path / files[k]) for k in wanted}

    def load_latest(self) -> tuple[Path, dict[str, Any]] | None:
        """The newest intact checkpoint and its state (for ``--resume``).

        Checkpoint directories are tried newest first; one that is torn (:meth:`problem`) is
        skipped with a one-line warning naming it and why, and the previous one is tried.

        Returns:
            ``(path, state)``, or None when the directory holds no ``step_*`` checkpoint at all.

        Raises:
            CheckpointError: there are checkpoints but none is intact (names the directory).
        """
        steps = sorted((int(m.group(1)), p) for p in self.directory.iterdir()
                       if (m := _STEP_RE.match(p.name)) is not None and p.is_dir())
        for _, p in reversed(steps):
            why = self.problem(p)
            if why is None:
                return p, self.load(p)
            log.warning("skipping torn checkpoint %s", why)
        if steps:
            raise CheckpointError(f"{self.directory}: none of its {len(steps)} checkpoint(s) is intact "
                                  "(see the warnings above); move them away to start from scratch")
        return None


# ------------------------------------------------------------------------ RNG
def rng_state() -> dict[str, Any]:
    """Capture the global RNG states: python ``random``, numpy's legacy global RNG, torch CPU and CUDA.

    Returns:
        ``{"python": tuple, "numpy": (name, int64 tensor of the 624 MT19937 words, pos,
        has_gauss, cached_gaussian), "torch": uint8 tensor, "torch_cuda": list of uint8 tensors
        (one per visible device) or None without CUDA}``: plain values and tensors only, so
        ``torch.load(weights_only=True)`` reads them.
        Generators owned by objects (``np.random.Generator``, ``torch.Generator``) are
        not global: save their ``.bit_generator.state`` / ``.get_state()`` yourself.
    """
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    return {
        "python": random.getstate(),
        "numpy": (kind, torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss), float(cached)),
        "torch": torch.get_rng_state(),
        "torch_cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
    }


def set_rng_state(d: dict[str, Any]) -> None:
    """Restore the states captured by ``rng_state()``.

    CUDA states are restored for ``min(saved, visible)`` devices; a mismatch (e.g. a
    GPU checkpoint resumed on a CPU-only machine) is logged as a warning, since the
    CUDA streams then cannot be reproduced.

    Raises:
        KeyError: if one of ``python``, ``numpy``, ``torch`` is missing from ``d``.
    """
    missing = [k for k in ("python", "numpy", "torch") if k not in d]
    if missing:
        raise KeyError(f"RNG state lacks {missing} (has {sorted(d)})")
    random.setstate(d["python"])
    kind, keys, *rest = d["numpy"]
    keys = keys.numpy().astype(np.uint32) if isinstance(keys, torch.Tensor) else keys  # older files: ndarray
    np.random.set_state((kind, keys, *rest))
    torch.set_rng_state(d["torch"])
    cuda = d.get("torch_cuda")
    visible = torch.cuda.device_count() if torch.cuda.is_available() else 0
    saved = len(cuda) if cuda else 0
    if saved != visible:
        log.warning(
            "RNG state has %d CUDA device state(s) but %d device(s) are visible; restoring %d",
            saved,
            visible,
            min(saved, visible),
        )
    for i in range(min(saved, visible)):
        torch.cuda.set_rng_state(cuda[i], device=i)
