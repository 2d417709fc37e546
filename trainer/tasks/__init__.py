"""Tasks as plug-ins: what ``copc train`` needs from an environment besides the model.

:func:`build_task` turns ``cfg.task`` into a started :class:`Task` (data splits, services,
environment factory, optional warm-start traces). The task class is chosen by environment id:

* ``math_tool`` → :class:`~trainer.tasks.math_tool.MathToolTask` (sandbox pool; datasets or
  generated arithmetic; ``retool_arithmetic`` warm start), one folder ``trainer/tasks/math_tool/``
  (task, arithmetic problems, traces, settings),
* ``search`` → :class:`~trainer.tasks.search.SearchTask` (retriever server; QA sets;
  ``search_r1`` warm start, copy drills), one folder ``trainer/tasks/search/`` (task, traces,
  drills, settings),
* any other registered environment → :class:`~trainer.tasks.generic.GenericTask` (rows from the
  JSONL files of ``task.train_data`` / ``task.eval_data``; no edit to ``trainer/`` needed),

unless a class was registered for that id with :func:`register_task`. A task's own knobs are its
settings dataclass (``Task.settings_class``, registered with it), filled from ``task.settings``
(:mod:`trainer.tasks.settings`). ``task.env`` may also name
the module that registers the environment (``"my_pkg.envs:calc"`` or ``"calc_env.py:calc"``,
see :func:`environments.resolve`); that module can register a task class as well.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING, Any

import environments
from copc.registries import Registry, RegistryError
from environments.data import data_root

from ..errors import ConfigError
from .base import DrillPlan, Task, check_env_settings
from .generic import GenericTask
from .math_tool import MathToolTask
from .math_tool.settings import MathToolSettings
from .remote import RemoteTask
from .search import SearchTask, start_retriever
from .search.settings import SearchSettings

if TYPE_CHECKING:
    from ..config import ExperimentConfig

#: Capability metadata of a task: ``headline_metric`` (the summary metric a sweep ranks cells by
#: when its spec names none: ``em`` for the QA task ``search``, ``accuracy`` otherwise);
#: ``delegated_settings`` (its ``task.settings`` are another task's, checked by that task when it
#: starts, not at load: ``remote``, whose settings are the served environment's task's).
TASK_METADATA = {"headline_metric": (str, "accuracy"), "delegated_settings": (bool, False)}

#: The task registry, environment id → :class:`Task` subclass (``math_tool``, ``search`` and
#: ``remote`` built in); a :class:`copc.Registry`. An id without an entry uses
#: :class:`GenericTask`.
TASKS: Registry[type[Task]] = Registry("task", TASK_METADATA, key="task.env")


def register_task(env_name: str, task_cls: type[Task], *, overwrite: bool = False,
                  settings: type | None = None, **metadata: Any) -> type[Task]:
    """Use ``task_cls`` for environment ``env_name`` (instead of :class:`GenericTask`).

    Args:
        env_name: a registered environment id (it may be registered later, before
            :func:`build_task`).
        task_cls: a :class:`Task` subclass, constructed as ``task_cls(cfg, env_id)``.
        overwrite: replace a class already registered for ``env_name`` (registering the same
            class again is always allowed: a module imported twice).
        settings: the task's settings dataclass (``task.settings``); None: the class's own
            ``settings_class`` (a class without one gets ``settings`` as its ``settings_class``).
        **metadata: capability metadata of :data:`TASKS`.

    Returns:
        ``task_cls``.

    Raises:
        TypeError: ``task_cls`` is not a :class:`Task` subclass.
        copc.registries.RegistryError: (a ``ValueError``) empty ``env_name``, a class is
            already registered for it and ``overwrite`` is False, or ``settings`` differs from
            the class's own ``settings_class``.
    """
    if not isinstance(task_cls, type) or not issubclass(task_cls, Task):
        raise TypeError(f"register_task({env_name!r}, ...): expected a Task subclass, got {task_cls!r}")
    if env_name in TASKS and not overwrite and TASKS.get(env_name) is not task_cls:
        raise RegistryError(f"a task class is already registered for env {env_name!r} "
                            f"({TASKS.get(env_name).__qualname__}); pass overwrite=True")
    own = task_cls.settings_class
    if settings is not None and own is not None and settings is not own:
        raise RegistryError(f"register_task({env_name!r}, {task_cls.__qualname__}): settings={settings!r} "
                            f"but the class's settings_class is {own!r}")
    if settings is not None and own is None:
        task_cls.settings_class = settings  # the class parses task.settings with it
    return TASKS.register(env_name, task_cls, overwrite=True, settings=task_cls.settings_class, **metadata)


def unregister_task(env_name: str) -> None:
    """Forget the task class registered for ``env_name`` (no error if there is none)."""
    if env_name in TASKS:
        TASKS.unregister(env_name)


def task_class(env_name: str) -> type[Task]:
    """The task class used for environment ``env_name``: the registered one, else
    :class:`GenericTask`."""
    return TASKS.get(env_name) if env_name in TASKS else GenericTask


def build_task(cfg: ExperimentConfig) -> Task:
    """Construct and start the task of ``cfg`` (its services running; close it when done).

    Steps: resolve ``task.env`` (importing its module if it names one), construct the task
    class of that id, :meth:`Task.start` it, then build one environment to check
    ``task.env_kwargs`` (:func:`check_env_settings`). On any failure the task is closed.

    Args:
        cfg: the experiment config.

    Returns:
        The started :class:`Task`.

    Raises:
        ConfigError: unknown or unimportable environment, bad data, or settings the environment
            rejects (the message names the key).
    """
    ref = cfg.task.env
    try:
        env_id = environments.resolve(ref)
    except KeyError:
        raise ConfigError(f"task.env={ref!r}: not registered; known: {environments.names()} (register it "
                          "with environments.register in a module named here as "
                          "'package.module:id' or 'path/to/file.py:id')") from None
    except (ImportError, OSError, ValueError) as e:
        raise ConfigError(f"task.env={ref!r}: cannot load the environment's module: "
                          f"{type(e).__name__}: {e}") from e
    task = task_class(env_id)(cfg, env_id)
    try:
        try:
            task.start()
        except FileNotFoundError as e:  # a data file of train_data / eval_data / the corpus
            from environments.data import data_root

            raise ConfigError(f"task.data_dir={cfg.task.data_dir!r}: {e} (data directory: "
                              f"{data_root(cfg.task.data_dir)}; set task.data_dir or $COPC_DATA_DIR, "
                              "default ../shared/data from the working directory)") from e
        check_env_settings(task.make_env, env_id, task.env_kwargs)
    except BaseException:
        task.close()
        raise
    return task


def absolute_task_paths(cfg: ExperimentConfig) -> ExperimentConfig:
    """``cfg`` with every path of its ``task`` section made absolute against the current working
    directory, for processes that may run elsewhere (e.g. Ray rollout workers building their own
    task): ``task.data_dir`` (resolved as :func:`environments.data.data_root` does, so
    ``COPC_DATA_DIR`` / the fallback are pinned too), ``task.retriever_index_dir``, a non-empty
    ``task.retriever_corpus``, and a ``.py`` file in ``task.env``.

    Args:
        cfg: the experiment config (not modified).

    Returns:
        A copy of ``cfg`` with the ``task`` section's paths absolute.
    """
    t = cfg.task
    env = t.env
    module, sep, env_id = env.rpartition(":")
    if sep and module.endswith(".py"):
        env = f"{Path(module).expanduser().resolve()}:{env_id}"
    task = dataclasses.replace(
        t, env=env, data_dir=str(data_root(t.data_dir)),
        retriever_index_dir=str(Path(t.retriever_index_dir).expanduser().resolve()),
        retriever_corpus=str(Path(t.retriever_corpus).expanduser().resolve()) if t.retriever_corpus else "")
    return dataclasses.replace(cfg, task=task)


register_task("math_tool", MathToolTask)
register_task("search", SearchTask, headline_metric="em")
register_task("remote", RemoteTask, delegated_settings=True)

__all__ = [
    "TASKS",
    "DrillPlan",
    "GenericTask",
    "MathToolSettings",
    "MathToolTask",
    "SearchSettings",
    "SearchTask",
    "Task",
    "absolute_task_paths",
    "build_task",
    "check_env_settings",
    "register_task",
    "start_retriever",
    "task_class",
    "unregister_task",
]
