"""The run's per-step training samples: ``<run>/samples/step_N.jsonl``, one JSON line per episode.

Written by ``copc train`` after each step (``logging.samples_per_step`` episodes, at most
``logging.samples_max_bytes`` bytes per file); the records are built by
:func:`trainer.orchestration.samples.step_samples`. Read by ``copc view``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

#: the samples folder inside a run directory.
SAMPLES_DIR = "samples"
_PER_TOKEN = ("tokens", "loss_mask", "advantage", "ratio", "versions")


def _cut(rec: dict[str, Any], budget: int) -> str | None:
    """``rec`` as one JSON line of at most ``budget`` bytes: whole, else its per-token lists cut
    to their first tokens (``"cut_tokens"`` = the original count); None if even 16 tokens do not fit."""
    line = json.dumps(rec, ensure_ascii=False, default=str) + "\n"
    if len(line.encode()) <= budget:
        return line
    n = len(rec.get("tokens", []))
    keep = n
    while keep > 16:
        keep //= 2
        cut = {**rec, **{k: rec[k][:keep] for k in _PER_TOKEN if k in rec}, "cut_tokens": n}
        line = json.dumps(cut, ensure_ascii=False, default=str) + "\n"
        if len(line.encode()) <= budget:
            return line
    return None


def write_step_samples(run_dir: str | Path, step: int, records: list[dict[str, Any]],
                       max_bytes: int) -> Path | None:
    """Write ``records`` to ``<run_dir>/samples/step_<step>.jsonl`` atomically, at most ``max_bytes``.

    Records are written in order while they fit; one that does not fit whole is cut to its first
    tokens (``cut_tokens`` says how many it had) or, if even that does not fit, left out with the
    rest. Returns the path, or None when nothing was written (no records).
    """
    if not records:
        return None
    out = Path(run_dir) / SAMPLES_DIR
    out.mkdir(parents=True, exist_ok=True)
    lines, used = [], 0
    for rec in records:
        line = _cut(rec, max_bytes - used)
        if line is None:
            break
        lines.append(line)
        used += len(line.encode())
    path = out / f"step_{step}.jsonl"
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text("".join(lines), encoding="utf-8")
    os.replace(tmp, path)
    return path


def read_samples(run_dir: str | Path) -> list[dict[str, Any]]:
    """Every sample record of a run, by step (torn or non-JSON lines are skipped)."""
    folder = Path(run_dir) / SAMPLES_DIR
    files = sorted(folder.glob("step_*.jsonl"), key=lambda p: int(p.stem.split("_")[1]) if
                   p.stem.split("_")[1].isdigit() else -1)
    out = []
    for f in files:
        for line in f.read_text(encoding="utf-8").splitlines():
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return out


__all__ = ["SAMPLES_DIR", "read_samples", "write_step_samples"]
