"""The real pretrained model the SmolLM2 benchmarks use (a directory, or a pulled model's name)."""

from __future__ import annotations

import os
from pathlib import Path

#: Default ``--model``: the name ``copc model pull`` knows, or ``$COPC_BENCH_MODEL``.
DEFAULT_MODEL = os.environ.get("COPC_BENCH_MODEL", "smollm2-135m-instruct")


def real_model_dir(spec: str) -> tuple[Path | None, str]:
    """``(directory, "")`` of ``spec`` (an existing directory, else a pulled model's name), or
    ``(None, reason)`` when it is neither a directory nor pullable here (the benchmark skips)."""
    p = Path(spec).expanduser()
    if p.is_dir():
        return p, ""
    try:
        from trainer.models.pull.pull import pull_model  # copc model pull (issue 22 item 1)
    except ImportError:
        return None, f"{spec!r} is not a directory and this checkout has no `copc model pull`"
    try:
        return Path(pull_model(spec)), ""
    except Exception as e:  # no network, unknown name: the benchmark reports and skips
        return None, f"cannot pull {spec!r}: {type(e).__name__}: {e}"
