"""The Makefile's main jobs pass ``ARGS`` to ``copc train`` as config overrides (``make -n``: not run)."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
JOBS = {"main": "configs/search/cpu_smollm.yaml", "main-search": "configs/search/cpu_smollm.yaml",
        "main-tiny": "configs/math_tool/cpu_tiny.yaml", "main-math": "configs/math_tool/cpu_smollm.yaml",
        "main-search-tiny": "configs/search/cpu_tiny.yaml"}

pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="needs make")


def _train_line(target: str, *make_args: str, env_args: str | None = None) -> str:
    """The ``trainer.cli train`` command ``make -n target`` prints (``env_args``: ARGS in the environment)."""
    env = {k: v for k, v in os.environ.items() if k not in ("ARGS", "MAKEFLAGS", "MAKELEVEL", "MFLAGS")}
    if env_args is not None:
        env["ARGS"] = env_args
    out = subprocess.run(["make", "-n", "-C", str(REPO), target, *make_args], capture_output=True,
                         text=True, check=True, env=env).stdout
    lines = [ln for ln in out.splitlines() if "trainer.cli train" in ln]
    assert len(lines) == 1, out
    return lines[0].strip()


@pytest.mark.parametrize("target", sorted(JOBS))
def test_args_reach_copc_train_after_the_config(target):
    line = _train_line(target, "ARGS=train.seed=2 output_dir=runs/s2")
    assert line.endswith(f"train --config {JOBS[target]} train.seed=2 output_dir=runs/s2"), line


@pytest.mark.parametrize("target", sorted(JOBS))
def test_without_args_the_command_is_the_config_alone(target):
    assert _train_line(target).endswith(f"train --config {JOBS[target]}")


def test_args_in_the_environment_is_ignored():
    assert _train_line("main-search", env_args="train.seed=9").endswith("configs/search/cpu_smollm.yaml")


@pytest.mark.parametrize("target", ["main", "main-math"])
def test_real_model_jobs_pull_the_model_before_training(target):
    """``make main`` trains a real pretrained model (issue 45 item 3): the pull comes before the train."""
    env = {k: v for k, v in os.environ.items() if k not in ("ARGS", "MAKEFLAGS", "MAKELEVEL", "MFLAGS")}
    out = subprocess.run(["make", "-n", "-C", str(REPO), target], capture_output=True, text=True, check=True,
                         env=env).stdout.splitlines()
    pull = [i for i, ln in enumerate(out) if "model pull smollm2-135m-instruct" in ln]
    train = [i for i, ln in enumerate(out) if "trainer.cli train" in ln]
    assert len(pull) == 1 and len(train) == 1 and pull[0] < train[0], out
