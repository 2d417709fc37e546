"""A task's own settings: a dataclass per task class, filled from ``task.settings``.

Each :class:`~trainer.tasks.base.Task` subclass names its settings dataclass in
``settings_class`` (None: the task has none), and :func:`trainer.tasks.register_task` registers it
with the task (``TASKS.settings_type(env_id)``). The config carries the values as a plain mapping,
``task.settings``, so the central schema (:class:`~trainer.config.TaskConfig`) never names a
task's knobs; :func:`parse_settings` turns the mapping into the dataclass (names and types checked
by :func:`seams.settings.build_settings`, then the dataclass's own ``__post_init__``) when the task
is constructed, i.e. when :func:`trainer.tasks.build_task` starts it, before anything runs.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..errors import ConfigError

#: The config section a task's settings live in.
SECTION = "task.settings"


def require(cond: bool, field: str, value: Any, why: str) -> None:
    """Raise ``ConfigError("task.settings.<field>=<value!r>: <why>")`` unless ``cond`` (for a
    settings dataclass's ``__post_init__``)."""
    if not cond:
        raise ConfigError(f"{SECTION}.{field}={value!r}: {why}")


def parse_settings(settings_class: type | None, values: Mapping[str, Any] | None, env_id: str) -> Any:
    """The settings object of a task from the ``task.settings`` mapping
    (:func:`seams.settings.build_settings`: names and types checked, then the dataclass's own
    ``__post_init__``).

    Args:
        settings_class: the task's settings dataclass (None: the task has no settings).
        values: ``task.settings`` (missing keys take the dataclass defaults).
        env_id: the environment id, for messages.

    Returns:
        An instance of ``settings_class``, or None when ``settings_class`` is None and ``values``
        is empty.

    Raises:
        ConfigError: a key that is not a field (the message lists the fields), a value of the
            wrong type, a value the dataclass refuses, or any value for a task without settings.
    """
    from seams.settings import build_settings

    values = dict(values or {})
    if settings_class is None:
        if values:
            raise ConfigError(f"{SECTION}.{sorted(values)[0]}: the task of env {env_id!r} has no settings")
        return None
    try:
        return build_settings(settings_class, values, SECTION)
    except ValueError as e:
        raise ConfigError(str(e)) from None


__all__ = ["SECTION", "parse_settings", "require"]
