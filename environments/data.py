"""JSONL data loading shared by the environments (validated, with line numbers in errors)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_DATA_DIR = "../shared/data"  # relative to the repository root


def resolve_data_path(path: str | Path, data_dir: str | Path = DEFAULT_DATA_DIR) -> Path:
    """Absolute path of a data file: absolute ``path`` as is, else under ``data_dir``
    (itself relative to the repository root when not absolute)."""
    p = Path(path)
    if p.is_absolute():
        return p
    base = Path(data_dir)
    if not base.is_absolute():
        base = REPO_ROOT / base
    return (base / p).resolve()


def load_jsonl(path: str | Path, required: Sequence[str], limit: int | None = None
               ) -> list[dict[str, Any]]:
    """Read JSON objects, one per line, checking that each has the ``required`` fields.

    Raises:
        FileNotFoundError: ``path`` does not exist (message names it).
        ValueError: a line is not a JSON object or lacks a field (message gives the line).
    """
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"data file {str(p)!r} not found")
    rows: list[dict[str, Any]] = []
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
            rows.append(row)
            if limit is not None and len(rows) >= limit:
                break
    return rows
