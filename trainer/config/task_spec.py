"""The typed spec a task gets instead of the experiment config: :class:`TaskSpec`, built by
:func:`task_spec` where a run is assembled (re-exported by :mod:`trainer.config.specs`).

A small module of its own (importing nothing but the config's sections) so the tasks layer and a
Ray rollout worker can build and use one without the heavier spec builders of the engines and
learners.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ..errors import ConfigError
from .sections import TaskConfig

if TYPE_CHECKING:  # typing only: the config package imports the sections this module uses
    from . import ExperimentConfig


@dataclass(frozen=True)
class TaskSpec:
    """What a task (:class:`~trainer.tasks.base.Task`) reads: its config section and the two
    settings of other sections its data splits depend on.

    Attributes:
        task: the ``task`` section (:class:`~trainer.config.TaskConfig`): ``env``, ``env_kwargs``,
            ``train_data`` / ``eval_data``, ``data_dir``, the sample caps and the task's own
            ``settings``. A Ray rollout worker's copy has its paths absolute and its settings those
            of the started task (:meth:`~trainer.tasks.base.Task.worker_spec`).
        seed: ``train.seed``: the seed of splits a task generates (``math_tool``'s arithmetic
            problems without ``task.train_data``).
        eval_num_samples: ``eval.num_samples``: the held-out cap used when
            ``task.max_eval_samples`` is 0 (:meth:`~trainer.tasks.base.Task.cap_eval`; 0: all).
    """

    task: TaskConfig = field(default_factory=TaskConfig)
    seed: int = 0
    eval_num_samples: int = 0

    def __getattr__(self, name: str) -> object:
        """Refuse, in one line, a read of an experiment-config section other than ``task``: a task
        written for the former ``__init__(self, cfg, env_id)`` now gets this spec as ``cfg``.

        Raises:
            ConfigError: ``name`` is one of :data:`OTHER_SECTIONS` (``cfg.train.seed`` ...), saying
                what to read instead.
            AttributeError: any other missing attribute.
        """
        if name in OTHER_SECTIONS:
            raise ConfigError(f"a task read cfg.{name}: a task gets a TaskSpec, not the experiment config; "
                              "read spec.task (the task section), spec.seed (train.seed) or "
                              "spec.eval_num_samples (eval.num_samples); docs/seams.md, Tasks")
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")


#: The experiment config's sections other than ``task``: what a task written for the former
#: ``__init__(self, cfg, env_id)`` may still read from the spec it now gets (refused in one line).
OTHER_SECTIONS = frozenset({"model", "train", "rollout", "learner", "eval", "logging", "checkpoint",
                            "launcher", "warm_start", "algorithm", "plugins", "output_dir"})


def task_spec(cfg: ExperimentConfig) -> TaskSpec:
    """The :class:`TaskSpec` of ``cfg``: its ``task`` section, ``train.seed`` and
    ``eval.num_samples`` (the section object itself, not a copy: the spec is built from a
    validated config that is not modified afterwards)."""
    return TaskSpec(task=cfg.task, seed=cfg.train.seed, eval_num_samples=cfg.eval.num_samples)


__all__ = ["TaskSpec", "task_spec"]
