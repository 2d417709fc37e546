"""Where the data lives, and JSONL loading shared by the environments (validated, with line
numbers in errors).

The data directory is, in order: an explicit ``data_dir`` (``task.data_dir`` in a config, the
``data_dir`` setting of an environment), else the environment variable ``COPC_DATA_DIR``, else
the repository's own ``data/`` folder (found from this file, whatever the working directory). A
relative ``data_dir`` or ``COPC_DATA_DIR`` is taken relative to the current working directory. An
installed copy (``pip install .``) has no ``data/`` beside its packages: there ``COPC_DATA_DIR``
names the data, and a missing file says so.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

#: Environment variable naming the data directory when no ``data_dir`` is given.
DATA_DIR_ENV = "COPC_DATA_DIR"
#: The data directory when neither ``data_dir`` nor ``COPC_DATA_DIR`` is set: ``data/`` of the
#: checkout this package lives in (absolute; absent in an installed copy).
FALLBACK_DATA_DIR = str(Path(__file__).resolve().parents[1] / "data")
#: Default ``data_dir`` of loaders and environment settings: empty means "not given", i.e.
#: ``COPC_DATA_DIR``, else :data:`FALLBACK_DATA_DIR` (see :func:`data_root`).
DEFAULT_DATA_DIR = ""


def data_root(data_dir: str | Path = DEFAULT_DATA_DIR) -> Path:
    """The absolute data directory.

    Args:
        data_dir: an explicit directory; empty (the default): ``$COPC_DATA_DIR`` if set and
            non-empty, else :data:`FALLBACK_DATA_DIR` (the repository's ``data/``). A relative
            directory is resolved against the current working directory.

    Returns:
        The directory as an absolute, normalised :class:`~pathlib.Path` (it need not exist).
    """
    chosen = str(data_dir) or os.environ.get(DATA_DIR_ENV, "") or FALLBACK_DATA_DIR
    return Path(chosen).expanduser().resolve()


def resolve_data_path(path: str | Path, data_dir: str | Path = DEFAULT_DATA_DIR) -> Path:
    """Absolute path of a data file.

    Args:
        path: an absolute path (returned as is) or a path relative to the data directory.
        data_dir: see :func:`data_root`.

    Returns:
        ``path`` itself when absolute, else ``data_root(data_dir) / path`` (normalised).
    """
    p = Path(path)
    if p.is_absolute():
        return p
    return (data_root(data_dir) / p).resolve()


def load_jsonl(path: str | Path, required: Sequence[str], limit: int | None = None
               ) -> list[dict[str, Any]]:
    """Read JSON objects, one per line, checking that each has the ``required`` fields.

    Blank lines are skipped.

    Args:
        path: the JSONL file.
        required: field names every row must have.
        limit: stop after this many rows (``None``: all).

    Returns:
        The rows, in file order.

    Raises:
        FileNotFoundError: ``path`` does not exist (message names it).
        ValueError: a line is not a JSON object or lacks a field (message gives the line).
    """
    return [row for _, row in iter_jsonl(path, required, limit)]


def iter_jsonl(path: str | Path, required: Sequence[str] = (), limit: int | None = None
               ) -> list[tuple[int, dict[str, Any]]]:
    """Like :func:`load_jsonl`, but each row comes with its 1-based line number.

    Args:
        path: the JSONL file.
        required: field names every row must have.
        limit: stop after this many rows (``None``: all).

    Returns:
        ``(line_number, row)`` pairs, in file order.

    Raises:
        FileNotFoundError: ``path`` does not exist (message names it).
        ValueError: ``"<path>:<line>: invalid JSON (...)"``, ``"... expected a JSON object"``
            or ``"... missing field(s) [...]"``.
    """
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"data file {str(p)!r} not found{_no_fallback_hint(p)}")
    rows: list[tuple[int, dict[str, Any]]] = []
    with p.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{p}:{lineno}: invalid JSON ({e.msg})") from None
            if not isinstance(row, dict):
                raise ValueError(f"{p}:{lineno}: expected a JSON object, got {type(row).__name__}")
            missing = [k for k in required if k not in row]
            if missing:
                raise ValueError(f"{p}:{lineno}: missing field(s) {missing}")
            rows.append((lineno, row))
            if limit is not None and len(rows) >= limit:
                break
    return rows


def _no_fallback_hint(path: Path) -> str:
    """What to do when ``path`` lies in the default data directory and that directory is absent
    (an installed copy, or a checkout without ``data/``); empty otherwise."""
    fallback = Path(FALLBACK_DATA_DIR)
    if fallback.is_dir() or not path.resolve().is_relative_to(fallback):
        return ""
    return (f" (the default data directory {FALLBACK_DATA_DIR!r} does not exist, as in an installed "
            f"copy: set ${DATA_DIR_ENV} to the folder holding the data)")
