"""Build what a task needs: an environment factory, train/eval samples, managed services.

``math_tool``: one shared bwrap :class:`~environments.sandbox.Sandbox` pool for all
episodes; data from ``task.train_data`` (``math_train``, ...) or, when empty,
generated arithmetic problems (the CPU main job). ``search``: a retriever server is
started (BM25 index built on first use, reused after) unless ``task.retriever_url``
is set; it is health-checked before use and stopped at exit.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import environments

from .config import ConfigError, ExperimentConfig

log = logging.getLogger(__name__)
REPO = Path(__file__).resolve().parents[1]


@dataclass
class Task:
    """A ready task.

    Attributes:
        make_env: zero-argument environment factory (one env per episode).
        train_samples / eval_samples: data rows (disjoint).
        closers: cleanup callbacks (sandbox pool, retriever server), run by :meth:`close`.
    """

    make_env: Callable[[], Any]
    train_samples: list[dict]
    eval_samples: list[dict]
    closers: list[Callable[[], None]] = field(default_factory=list)
    info: dict[str, Any] = field(default_factory=dict)

    def close(self) -> None:
        """Release the task's services (idempotent)."""
        while self.closers:
            with contextlib.suppress(Exception):
                self.closers.pop()()


def _resolve(p: str) -> Path:
    path = Path(p)
    return path if path.is_absolute() else REPO / path


def _cap(rows: list[dict], n: int) -> list[dict]:
    return rows[:n] if n else rows


def build_task(cfg: ExperimentConfig) -> Task:
    """Construct the task of ``cfg`` (starting services as needed).

    Raises:
        ConfigError: unknown environment / dataset (message names the key).
    """
    t = cfg.task
    if t.env not in environments.list():
        raise ConfigError(f"task.env={t.env!r}: not registered; known: {environments.list()}")
    if t.env == "math_tool":
        task = _math_task(cfg)
    elif t.env == "search":
        task = _search_task(cfg)
    else:
        kwargs = dict(t.env_kwargs)
        task = Task(make_env=lambda: environments.make(t.env, **kwargs), train_samples=[], eval_samples=[])
    try:
        check_env_settings(task.make_env, t.env, dict(t.env_kwargs))
    except BaseException:
        task.close()
        raise
    return task


_UNEXPECTED_KW = re.compile(r"unexpected keyword argument '([^']+)'")
_FIELD_VALUE = re.compile(r"\b\w+\.(\w+)=(.+?): (.*)$", re.DOTALL)


def _find_key(tree: Any, key: str, value: Any = None, path: str = "") -> str | None:
    """Dotted path of ``key`` in nested mappings ``tree`` (whose value's repr is ``value``, if given)."""
    if not isinstance(tree, dict):
        return None
    for k, v in tree.items():
        here = f"{path}.{k}" if path else str(k)
        if k == key and (value is None or repr(v) == value):
            return here
        found = _find_key(v, key, value, here)
        if found:
            return found
    return None


def check_env_settings(make_env: Callable[[], Any], env_id: str, env_kwargs: dict[str, Any]) -> None:
    """Build (and close) one environment so bad ``task.env_kwargs`` fail at load, not in rollouts.

    Environments validate their settings in their constructor (``TypeError`` for an unknown
    keyword, ``ValueError`` naming ``Config.field=value``, ``OSError`` for missing data); all become a
    :class:`ConfigError` naming the key under ``task.env_kwargs`` when it can be found in
    ``env_kwargs`` (e.g. ``task.env_kwargs.reward.mode='math-verify': must be one of ...``).

    Raises:
        ConfigError: the environment rejected its settings.
    """
    try:
        env = make_env()
    except TypeError as e:
        m = _UNEXPECTED_KW.search(str(e))
        if m is None:
            raise ConfigError(f"task.env_kwargs: env {env_id!r} rejected its settings: {e}") from e
        path = _find_key(env_kwargs, m.group(1)) or m.group(1)
        raise ConfigError(f"task.env_kwargs.{path}: not a setting of env {env_id!r} ({e})") from e
    except OSError as e:  # e.g. task.env_kwargs.dataset naming a file that does not exist
        where = "task.env_kwargs.dataset" if "dataset" in env_kwargs else "task.env_kwargs"
        raise ConfigError(f"{where}: env {env_id!r} could not load its data: {type(e).__name__}: {e}") from e
    except ValueError as e:
        m = _FIELD_VALUE.search(str(e))
        path = _find_key(env_kwargs, m.group(1), m.group(2)) if m else None
        if path is None:
            raise ConfigError(f"task.env_kwargs: env {env_id!r} rejected its settings: {e}") from e
        raise ConfigError(f"task.env_kwargs.{path}={m.group(2)}: {m.group(3)}") from e
    close = getattr(env, "close", None)
    if close is not None:
        close()


def _math_task(cfg: ExperimentConfig) -> Task:
    from environments.math_tool import load_math
    from environments.sandbox import Sandbox, SandboxConfig

    t = cfg.task
    data_dir = str(_resolve(t.data_dir))
    if t.train_data:
        train = [r for name in t.train_data for r in load_math(name, data_dir)]
        evals = [r for name in (t.eval_data or ["math500"]) for r in load_math(name, data_dir)]
    else:
        from .warmstart import arithmetic_splits
        n_train = t.max_train_samples or 2000
        n_eval = t.max_eval_samples or cfg.eval.num_samples
        kinds = tuple(t.arithmetic_kinds) or ("mul", "sum_of_products", "mul_minus")
        train, evals = arithmetic_splits(n_train, n_eval, seed=cfg.train.seed, kinds=kinds)
    sandbox = Sandbox(SandboxConfig(workers=2))
    kwargs = dict(t.env_kwargs)

    def make_env() -> Any:
        return environments.make("math_tool", sandbox=sandbox, **kwargs)

    return Task(make_env=make_env, train_samples=_cap(train, t.max_train_samples),
                eval_samples=_cap(evals, t.max_eval_samples or cfg.eval.num_samples),
                closers=[sandbox.close], info={"sandbox": sandbox.enforced})


def _search_task(cfg: ExperimentConfig) -> Task:
    from environments.search.env import load_qa

    t = cfg.task
    data_dir = str(_resolve(t.data_dir))
    names = t.train_data or ["nq", "hotpotqa"]
    rows = [dict(r, id=f"{n}:{r['id']}", dataset=n) for n in names for r in load_qa(n, data_dir)]
    eval_names = t.eval_data or names
    if set(eval_names) <= set(names):
        # evaluate on held-out rows of the training sets: every 5th row (deterministic, disjoint)
        evals = [r for i, r in enumerate(rows) if i % 5 == 0 and r["dataset"] in eval_names]
        held = {r["id"] for r in evals}
        train = [r for r in rows if r["id"] not in held and rows.index(r) % 5]
    else:
        evals = [dict(r, id=f"{n}:{r['id']}", dataset=n) for n in eval_names for r in load_qa(n, data_dir)]
        held = {r["id"] for r in evals}
        train = [r for r in rows if r["id"] not in held]
    closers: list[Callable[[], None]] = []
    url = t.retriever_url
    if not url:
        url, stop = start_retriever(_resolve(t.retriever_corpus), _resolve(t.retriever_index_dir))
        closers.append(stop)
    kwargs = dict(t.env_kwargs)

    def make_env() -> Any:
        return environments.make("search", retriever_url=url, **kwargs)

    return Task(make_env=make_env, train_samples=_cap(train, t.max_train_samples),
                eval_samples=_cap(evals, t.max_eval_samples or cfg.eval.num_samples),
                closers=closers, info={"retriever_url": url})


def start_retriever(corpus: Path, index_dir: Path, timeout_s: float = 180.0
                    ) -> tuple[str, Callable[[], None]]:
    """Start a BM25 retriever server on 127.0.0.1 (building the index on first use).

    Args:
        corpus: JSONL corpus path.
        index_dir: index directory (built if it has no ``meta.json``; reused otherwise).
        timeout_s: how long to wait for ``/health`` (seconds).

    Returns:
        ``(url, stop)``: the base URL and a function that stops the server.

    Raises:
        RuntimeError / TimeoutError: if the server exits or is not healthy in time (the
            message includes the server's output, also kept in ``<index_dir>/../server-*.log``).
    """
    from retriever.launch import ensure_bm25_index, start_server

    log.info("retriever: BM25 index of %s in %s", corpus, index_dir)
    ensure_bm25_index(corpus, index_dir, show_progress=True)
    server = start_server(index_dir, timeout_s=timeout_s,
                          log_path=index_dir.parent / f"server-{os.getpid()}.log")
    return server.url, server.stop
