"""Warm-starts shared between runs (``warm_start.cache_dir``): identical settings, one SFT.

A sweep's cells differ in RL settings only, yet each used to repeat the same supervised
warm-start (three quarters of a CPU-tiny run). The warm-start result depends on the model, the
task, the rollout budgets, the ``warm_start`` section and the global seed; :func:`cache_key`
hashes exactly those, so runs that agree on them share one result and nothing else can collide.
Entries are written to a temporary directory and renamed into place (atomic), so runs started in
parallel never read a half-written model: the first to finish wins, the others discard theirs.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..config.specs import WarmStartCacheSpec

#: Bump when the warm-start procedure changes in a way old entries must not be reused for.
CACHE_FORMAT = 2
#: ``rollout`` keys that only concern RL generation (engine, sampling, concurrency), never the
#: supervised warm-start; the episode budgets (``max_*``, ``use_chat_template``) stay in the key.
_ROLLOUT_NOT_SFT = frozenset({"engine", "temperature", "top_p", "top_k", "n_samples_per_prompt",
                              "concurrency", "engine_max_batch_size", "engine_settings"})


def cache_key(spec: WarmStartCacheSpec) -> str:
    """Hash of the settings a warm-start result depends on.

    Args:
        spec: those settings, read from the experiment config by
            :func:`trainer.config.specs.warm_start_cache_spec`.

    Returns:
        A 20-hex-digit key: SHA-256 of the canonical JSON of ``model``, ``task``, ``rollout``
        (minus the RL-generation keys :data:`_ROLLOUT_NOT_SFT`), ``warm_start`` (minus
        ``cache_dir``, and ``micro_batch_size`` when 0), ``train.seed``, ``train.torch_threads``,
        the learner's ``autocast_dtype`` (only when set: keys of runs without it are unchanged)
        and :data:`CACHE_FORMAT`.
        RL settings (preset, algorithm, staleness, learning rates of RL,
        evaluation) are not part of it.
    """
    ws = dataclasses.asdict(spec.warm_start)
    ws.pop("cache_dir", None)
    if not ws.get("micro_batch_size"):  # 0, the whole batch: keys from before the setting are unchanged
        ws.pop("micro_batch_size", None)
    rollout = {k: v for k, v in dataclasses.asdict(spec.rollout).items() if k not in _ROLLOUT_NOT_SFT}
    parts = {"format": CACHE_FORMAT, "model": dataclasses.asdict(spec.model),
             "task": dataclasses.asdict(spec.task), "rollout": rollout,
             "warm_start": ws, "seed": spec.seed, "torch_threads": spec.torch_threads}
    if spec.autocast_dtype is not None:  # the SFT computes in it: another result
        parts["autocast_dtype"] = spec.autocast_dtype
    blob = json.dumps(parts, sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:20]


def lookup(cache_dir: str | Path, key: str) -> Path | None:
    """The cached warm-start directory for ``key``, or None when there is none (complete entries
    only: they appear by an atomic rename)."""
    d = Path(cache_dir) / key
    return d if (d / "config.json").exists() else None


def store(cache_dir: str | Path, key: str, src: str | Path) -> Path:
    """Copy the warm-start directory ``src`` into the cache under ``key`` (atomic; an entry that
    appeared meanwhile is kept and the copy discarded).

    Returns:
        The cache entry's directory.

    Raises:
        OSError: the cache directory cannot be written.
    """
    root = Path(cache_dir)
    root.mkdir(parents=True, exist_ok=True)
    final = root / key
    if lookup(root, key) is not None:
        return final
    tmp = Path(tempfile.mkdtemp(prefix=f".{key}.", dir=root))
    try:
        shutil.copytree(src, tmp, dirs_exist_ok=True)
        try:
            os.rename(tmp, final)
        except OSError:  # another run stored the same key first
            if lookup(root, key) is None:
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return final


def restore(cache_dir: str | Path, key: str, dst: str | Path) -> bool:
    """Copy the cached entry for ``key`` to ``dst`` (the run's ``warm_start_model``) if there is one.

    Returns:
        Whether an entry was found and copied.
    """
    src = lookup(cache_dir, key)
    if src is None:
        return False
    tmp = Path(f"{dst}.partial")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(src, tmp)
    os.replace(tmp, dst)
    return True
