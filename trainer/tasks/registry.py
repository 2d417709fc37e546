"""The task registry: environment id → :class:`~trainer.tasks.base.Task` subclass, with each
task's settings dataclass and capability metadata (:data:`TASKS`, a :class:`seams.registry.Registry`).

The built-in tasks are registered by :mod:`trainer.tasks` (its ``__init__``); a module of its own so
that a task (``remote``) can look a class up without importing the package that registers it.
"""

from __future__ import annotations

from typing import Any

from seams.registry import Registry, RegistryError

from .base import Task
from .generic import GenericTask

#: Capability metadata of a task: ``headline_metric`` (the summary metric a sweep ranks cells by
#: when its spec names none: ``em`` for the QA task ``search``, ``accuracy`` otherwise);
#: ``delegated_settings`` (its ``task.settings`` are another task's, checked by that task when it
#: starts, not at load: ``remote``, whose settings are the served environment's task's).
TASK_METADATA = {"headline_metric": (str, "accuracy"), "delegated_settings": (bool, False)}

#: The task registry, environment id → :class:`Task` subclass (``math_tool``, ``search`` and
#: ``remote`` built in); a :class:`seams.registry.Registry`. An id without an entry uses
#: :class:`GenericTask`.
TASKS: Registry[type[Task]] = Registry("task", TASK_METADATA, key="task.env")


def register_task(env_name: str, task_cls: type[Task], *, overwrite: bool = False,
                  settings: type | None = None, **metadata: Any) -> type[Task]:
    """Use ``task_cls`` for environment ``env_name`` (instead of :class:`GenericTask`).

    Args:
        env_name: a registered environment id (it may be registered later, before
            :func:`build_task`).
        task_cls: a :class:`Task` subclass, constructed as ``task_cls(spec, env_id)``
            (``spec``: a :class:`~trainer.config.specs.TaskSpec`, see :class:`Task`).
        overwrite: replace a class already registered for ``env_name`` (registering the same
            class again is always allowed: a module imported twice).
        settings: the task's settings dataclass (``task.settings``); None: the class's own
            ``settings_class`` (a class without one gets ``settings`` as its ``settings_class``).
        **metadata: capability metadata of :data:`TASKS`.

    Returns:
        ``task_cls``.

    Raises:
        TypeError: ``task_cls`` is not a :class:`Task` subclass.
        seams.registry.RegistryError: (a ``ValueError``) empty ``env_name``, a class is
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


__all__ = ["TASKS", "TASK_METADATA", "register_task", "task_class", "unregister_task"]
