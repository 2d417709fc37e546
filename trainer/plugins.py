"""User plug-ins: modules imported before a config is validated, in every process of a run.

``plugins: [my_pkg.algos, path/to/my_env.py]`` in a config (or ``plugins=[...]`` on the command
line) names modules whose import registers environments, tasks, advantage estimators, policy
losses, engines or learner backends. :func:`trainer.config.load_config` imports them before
validating (so ``algorithm.advantage_estimator: my_est`` passes), and the Ray rollout workers
and learner actor import them again in their own processes.

The plug-ins the config *names* (an engine, a learner backend, a task, ...) are looked up
through :data:`SEAMS`: for each, the config key of the name, the registry (by module name, so
the config imports no plug-in package) and the key of the plug-in's own settings section,
validated by the settings dataclass registered with the name (:func:`plugin_settings`).
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from seams.registry import Registry

from .errors import ConfigError


def import_plugins(refs: Sequence[str]) -> None:
    """Import each plug-in: a dotted module name or a ``.py`` file (relative to the current
    working directory; loaded once per process, its directory put on ``sys.path``).

    Raises:
        ConfigError: naming ``plugins[i]`` when one cannot be imported (the cause in the message).
    """
    from environments.registry import import_env_module

    for i, ref in enumerate(refs):
        try:
            import_env_module(str(ref))
        except Exception as e:  # the user's module: report any failure as a config error
            raise ConfigError(f"plugins[{i}]={ref!r}: cannot import it: {type(e).__name__}: {e}") from e


def absolute_plugins(refs: Sequence[str]) -> list[str]:
    """``refs`` with ``.py`` paths made absolute (for processes with another working directory)."""
    return [str(Path(r).expanduser().resolve()) if str(r).endswith(".py") else str(r) for r in refs]


@dataclass(frozen=True)
class Seam:
    """One extension kind that the config names by a registered name, with its own settings.

    Attributes:
        kind: what is registered (``"engine"``), for messages.
        key: the config key holding the name (``"rollout.engine"``).
        registry: where the :class:`seams.registry.Registry` lives, ``"package.module:ATTRIBUTE"``;
            importing that module registers the built-in plug-ins of the kind.
        settings_key: the config key of the plug-in's own settings (``"rollout.engine_settings"``),
            validated by the settings dataclass the name was registered with.
        resolve: ``"package.module:function"`` turning the config value into a registry name
            (``task.env`` → an environment id), or empty (the value is the name).
        optional: a name without a registration is allowed (it then takes no settings; a task
            of an environment without a registered task class is the generic task).
    """

    kind: str
    key: str
    registry: str
    settings_key: str
    resolve: str = ""
    optional: bool = False


#: The seams the config names (a lookup table, so the config imports no plug-in package: each
#: registry is imported by name when a config is validated). A new seam is one row here.
SEAMS: tuple[Seam, ...] = (
    Seam("engine", "rollout.engine", "trainer.engines.registry:ENGINES", "rollout.engine_settings"),
    Seam("learner backend", "learner.backend", "trainer.learner.registry:LEARNERS",
         "learner.backend_settings"),
    Seam("task", "task.env", "trainer.tasks:TASKS", "task.settings", resolve="environments:resolve",
         optional=True),
    Seam("launcher", "launcher.kind", "trainer.orchestration.launchers:LAUNCHERS", "launcher.settings"),
)


def load_ref(ref: str) -> Any:
    """The object a ``"package.module:ATTRIBUTE"`` reference names (its module imported)."""
    module, _, attr = ref.partition(":")
    return getattr(importlib.import_module(module), attr)


def seam(key: str) -> Seam:
    """The :class:`Seam` whose name lives at config key ``key`` (``"rollout.engine"``).

    Raises:
        KeyError: no seam has that key.
    """
    for s in SEAMS:
        if s.key == key:
            return s
    raise KeyError(f"no plug-in seam at config key {key!r}; seams: {[s.key for s in SEAMS]}")


def registry(key: str) -> Registry:
    """The :class:`seams.registry.Registry` of the seam at config key ``key`` (its module imported, so the
    built-ins are registered)."""
    return load_ref(seam(key).registry)
