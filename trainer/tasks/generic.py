"""The task of any registered environment without a task of its own: rows from JSONL files.

``task.train_data`` lists JSONL files (paths relative to the data directory, see
:func:`environments.data.data_root`, or absolute), one JSON object per line; each row is given
to the environment as ``reset(options={"sample": row})``. Rows without an ``"id"`` get
``"<file stem>:<line number>"``. ``task.eval_data`` lists the held-out files; training rows
equal to a held-out row (ignoring ``id``) are dropped, so the splits are disjoint. With no
``task.eval_data``, every 5th training row (rows 0, 5, 10, ...) is held out instead. Caps:
``task.max_train_samples`` and ``task.max_eval_samples`` (else ``eval.num_samples``). No
services, no warm-start traces.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from pathlib import Path

from environments.data import data_root, iter_jsonl, resolve_data_path

from ..config import ConfigError
from .base import Task

log = logging.getLogger(__name__)

#: One in this many training rows is held out when ``task.eval_data`` is empty.
HOLD_OUT_EVERY = 5


def load_rows(key: str, names: Sequence[str], data_dir: str) -> tuple[list[dict], list[str]]:
    """Read the JSONL files ``names`` (the value of config key ``key``) into rows.

    Args:
        key: the config key, for messages (``"task.train_data"``).
        names: file paths, relative to the data directory or absolute.
        data_dir: ``task.data_dir`` (see :func:`environments.data.data_root`).

    Returns:
        ``(rows, paths)``: the rows of all files in order (``"id"`` added where missing, as
        ``"<file stem>:<line>"``) and the absolute file paths.

    Raises:
        ConfigError: a file is missing, empty, or has a line that is not a JSON object; the
            message names the key, the entry and (for a bad line) the file and line number.
    """
    rows: list[dict] = []
    paths: list[str] = []
    for i, name in enumerate(names):
        path = resolve_data_path(name, data_dir)
        where = f"{key}[{i}]={name!r}"
        try:
            numbered = iter_jsonl(path)
        except FileNotFoundError:
            raise ConfigError(f"{where}: no such file {str(path)!r} (relative entries are read from the "
                              f"data directory {str(data_root(data_dir))!r}: task.data_dir, else "
                              "$COPC_DATA_DIR, else the repository's data/)") from None
        except ValueError as e:
            raise ConfigError(f"{where}: {e}") from None
        if not numbered:
            raise ConfigError(f"{where}: {str(path)!r} has no rows")
        stem = Path(str(name)).stem
        for lineno, row in numbered:
            row.setdefault("id", f"{stem}:{lineno}")
            rows.append(row)
        paths.append(str(path))
    return rows, paths


def _content(row: dict) -> str:
    """A row's identity for the disjointness check: its fields except ``id``."""
    return json.dumps({k: v for k, v in row.items() if k != "id"}, sort_keys=True, default=str)


class GenericTask(Task):
    """Any registered environment, trained on JSONL rows (see the module docstring).

    ``info``: ``train_files`` / ``eval_files`` (absolute paths), ``held_out`` (how the eval rows
    were chosen: ``"task.eval_data"`` or ``"every 5th training row"``), and
    ``dropped_train_rows`` (training rows dropped because a held-out row equals them).
    """

    def start(self) -> None:
        """Read the splits.

        Raises:
            ConfigError: ``task.train_data`` is empty, or a file is missing / empty / malformed
                (the message names the key and, for a bad line, the file and line number).
        """
        t = self.spec.task
        if not t.train_data:
            raise ConfigError(
                f"task.train_data=[]: env {self.env_id!r} has no built-in data; list JSONL files of rows "
                "(one JSON object per line, each passed as reset(options={'sample': row})), relative to "
                f"the data directory {str(data_root(t.data_dir))!r} or absolute")
        train, train_files = load_rows("task.train_data", t.train_data, t.data_dir)
        dropped = 0
        if t.eval_data:
            evals, eval_files = load_rows("task.eval_data", t.eval_data, t.data_dir)
            held = {_content(r) for r in evals}
            kept = [r for r in train if _content(r) not in held]
            dropped, train = len(train) - len(kept), kept
            if dropped:
                log.warning("task %r: dropped %d training row(s) equal to a held-out row",
                            self.env_id, dropped)
            how = "task.eval_data"
        else:
            evals = train[::HOLD_OUT_EVERY]
            train = [r for i, r in enumerate(train) if i % HOLD_OUT_EVERY]
            eval_files, how = [], f"every {HOLD_OUT_EVERY}th training row"
        if not train:
            raise ConfigError(f"task.train_data={list(t.train_data)!r}: no training rows left (every row "
                              "is also a held-out row)")
        self.train_samples = self.cap_train(train)
        self.eval_samples = self.cap_eval(evals)
        self.info = {"train_files": train_files, "eval_files": eval_files, "held_out": how,
                     "dropped_train_rows": dropped}


__all__ = ["HOLD_OUT_EVERY", "GenericTask", "load_rows"]
