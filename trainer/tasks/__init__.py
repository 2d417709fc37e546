"""Tasks as plug-ins: what ``copc train`` needs from an environment besides the model.

:func:`build_task` turns a :class:`~trainer.config.specs.TaskSpec` (the ``task`` section with
``train.seed`` and ``eval.num_samples``, built by :func:`trainer.config.specs.task_spec`) into a
started :class:`Task` (data splits, services, environment factory, optional warm-start traces).
The task class is chosen by environment id:

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

from typing import TYPE_CHECKING

import environments
from seams.registry import RegistryError

from ..errors import ConfigError
from .base import DrillPlan, EvalOption, Task, absolute_task_paths, check_env_settings
from .generic import GenericTask
from .harness import HarnessTask
from .math_tool import MathToolTask
from .math_tool.settings import MathToolSettings
from .registry import TASK_METADATA, TASKS, register_task, task_class, unregister_task
from .remote import RemoteTask
from .search import SearchTask
from .search.settings import SearchSettings

if TYPE_CHECKING:
    from ..config.specs import TaskSpec


def build_task(spec: TaskSpec) -> Task:
    """Construct and start the task of ``spec`` (its services running; close it when done).

    Steps: resolve ``task.env`` (importing its module if it names one), construct the task
    class of that id, :meth:`Task.start` it, then build one environment to check
    ``task.env_kwargs`` (:func:`check_env_settings`). On any failure the task is closed.

    Args:
        spec: the task's spec (:func:`trainer.config.specs.task_spec` of the experiment config; a
            Ray rollout worker's: :meth:`Task.worker_spec` of the driver's task).

    Returns:
        The started :class:`Task`.

    Raises:
        ConfigError: unknown or unimportable environment, bad data, or settings the environment
            rejects (the message names the key).
    """
    ref = spec.task.env
    try:
        env_id = environments.resolve(ref)
    except RegistryError:  # not registered (after importing its module)
        raise ConfigError(f"task.env={ref!r}: not registered; known: {environments.names()} (register it "
                          "with environments.register in a module named here as "
                          "'package.module:id' or 'path/to/file.py:id')") from None
    except (ImportError, OSError, ValueError) as e:
        raise ConfigError(f"task.env={ref!r}: cannot load the environment's module: "
                          f"{type(e).__name__}: {e}") from e
    task = task_class(env_id)(spec, env_id)
    try:
        try:
            task.start()
        except FileNotFoundError as e:  # a data file of train_data / eval_data / the corpus
            from environments.data import data_root

            raise ConfigError(f"task.data_dir={spec.task.data_dir!r}: {e} (data directory: "
                              f"{data_root(spec.task.data_dir)}; set task.data_dir or $COPC_DATA_DIR, "
                              "default: the repository's data/)") from e
        check_env_settings(task.make_env, env_id, task.env_kwargs)
    except BaseException:
        task.close()
        raise
    return task


register_task("math_tool", MathToolTask)
register_task("search", SearchTask, headline_metric="em")
register_task("remote", RemoteTask, delegated_settings=True)
if "harness" not in environments.names():
    environments.register("harness", entry_point="trainer.harness.env:HarnessEnv")
register_task("harness", HarnessTask)

__all__ = [
    "TASKS",
    "TASK_METADATA",
    "DrillPlan",
    "EvalOption",
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
    "task_class",
    "unregister_task",
]
