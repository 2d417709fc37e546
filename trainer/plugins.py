"""User plug-ins: modules imported before a config is validated, in every process of a run.

``plugins: [my_pkg.algos, path/to/my_env.py]`` in a config (or ``plugins=[...]`` on the command
line) names modules whose import registers environments, tasks, advantage estimators, policy
losses, engines or learner backends. :func:`trainer.config.load_config` imports them before
validating (so ``algorithm.advantage_estimator: my_est`` passes), and the Ray rollout workers
and learner actor import them again in their own processes.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

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
