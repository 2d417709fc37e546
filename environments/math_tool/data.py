"""Math datasets (fields in data/SOURCES.md): ``{"id", "problem", "answer", ...}``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..data import DEFAULT_DATA_DIR, load_jsonl, resolve_data_path

MATH_DATASETS = {
    "math_train": "math_train.jsonl",
    "math500": "math500.jsonl",
    "aime2024": "aime2024.jsonl",
    "aime2025": "aime2025.jsonl",
    "gsm8k_train": "gsm8k_train.jsonl",
    "gsm8k_test": "gsm8k_test.jsonl",
}


def load_math(dataset: str | Path, data_dir: str | Path = DEFAULT_DATA_DIR,
              limit: int | None = None) -> list[dict[str, Any]]:
    """Load a math set by name (``math_train``, ``math500``, ``aime2024``, ``aime2025``, ``gsm8k_train``,
    ``gsm8k_test``) or path.

    Returns rows with at least ``id`` (str), ``problem`` (str), ``answer`` (str).

    Raises:
        FileNotFoundError / ValueError: see :func:`environments.data.load_jsonl`.
    """
    name = MATH_DATASETS.get(str(dataset), dataset)
    rows = load_jsonl(resolve_data_path(name, data_dir), ("id", "problem", "answer"), limit)
    for r in rows:
        r["answer"] = str(r["answer"])
    return rows
