"""A task or launcher plug-in written for the former interfaces (a task's ``__init__(self, cfg,
env_id)`` reading other config sections or ``self.cfg``; a launcher reading ``spec.cfg``) is refused
in one line saying what to read instead, not with a bare ``AttributeError`` traceback; the spec's
other behaviour (pickling, missing attributes) is unchanged."""

from __future__ import annotations

import dataclasses
import pickle
from pathlib import Path

import pytest

from trainer.config import ConfigError, TaskConfig
from trainer.config.task_spec import OTHER_SECTIONS, TaskSpec
from trainer.orchestration.launchers import LaunchSpec
from trainer.tasks.base import Task


class OldInit(Task):
    """Written for ``__init__(self, cfg, env_id)``: reads ``cfg.train.seed``."""

    def __init__(self, cfg, env_id=None):
        super().__init__(cfg, env_id)
        self.seed = cfg.train.seed


class OldSelfCfg(Task):
    """Reads the former ``self.cfg`` attribute."""

    def start(self):
        self.n = self.cfg.task.max_train_samples


def test_an_old_init_reading_another_section_is_one_line_naming_the_new_spelling():
    with pytest.raises(ConfigError) as ei:
        OldInit(TaskSpec(task=TaskConfig(env="old_env")), "old_env")
    msg = str(ei.value)
    assert msg.startswith("a task read cfg.train: a task gets a TaskSpec, not the experiment config") \
        and "spec.seed (train.seed)" in msg and "\n" not in msg
    assert OldInit.__mro__[1] is Task  # the base class's own construction ran first: only the read fails


def test_self_cfg_is_one_line_naming_the_task():
    task = OldSelfCfg(TaskSpec(task=TaskConfig(env="old_env")), "old_env")
    with pytest.raises(ConfigError, match=r"^task 'old_env' \(OldSelfCfg\) read self\.cfg: a task has "
                                          r"self\.spec"):
        task.start()


def test_the_task_section_and_the_specs_own_fields_still_read_and_it_pickles():
    spec = TaskSpec(task=TaskConfig(env="e", max_train_samples=3), seed=7, eval_num_samples=5)
    assert (spec.task.max_train_samples, spec.seed, spec.eval_num_samples) == (3, 7, 5)
    assert pickle.loads(pickle.dumps(spec)) == spec  # a Ray worker's copy
    assert dataclasses.replace(spec, seed=8).seed == 8
    with pytest.raises(AttributeError, match="no attribute 'nonsense'"):  # no section: AttributeError
        spec.nonsense  # noqa: B018
    assert not hasattr(spec, "nonsense") and {"train", "eval", "model", "rollout"} <= OTHER_SECTIONS
    assert "task" not in OTHER_SECTIONS


def test_a_launcher_reading_spec_cfg_is_one_line():
    spec = LaunchSpec(kind="old_wrap", settings=None, learner=None, engine=None, task=None,
                      tokenizer=None, model_dir=Path("."), sampling=None, agent_cfg=None, concurrency=4,
                      engine_kind="embedded", engine_spec=None, learner_spec=None)
    with pytest.raises(ConfigError) as ei:
        spec.cfg  # noqa: B018
    msg = str(ei.value)
    assert msg.startswith("launcher 'old_wrap' read spec.cfg: a launcher gets a LaunchSpec without the "
                          "experiment config") and "spec.concurrency" in msg and "\n" not in msg
