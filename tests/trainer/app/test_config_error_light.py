"""A bad config is reported before anything heavy is imported (issue 42 item 5): the real ``copc``
command line (``trainer.cli.main``) runs in a fresh interpreter on a config error of each kind (a
bad value, an unknown key, a key that moved, a built-in's knob under another component, a
plug-in's setting, a capability check) and prints its one line; neither torch nor transformers
is in ``sys.modules`` afterwards, so the whole validation (presets, the registries' names,
metadata and settings dataclasses) ran on light modules."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
CONFIG = "configs/math_tool/cpu_tiny.yaml"
HEAVY = ("torch", "transformers")

#: The ``copc`` main in a fresh interpreter; prints its exit code and the heavy modules it imported.
SCRIPT = f"""
import json, sys
from trainer.cli import main
try:
    rc = main(sys.argv[1:])
except SystemExit as e:
    rc = e.code
print(json.dumps({{"rc": rc, "heavy": sorted(m for m in {HEAVY!r} if m in sys.modules)}}))
"""

CASES = [
    (["train", "--config", CONFIG, "train.total_steps=0"],
     "copc train: config error: train.total_steps=0: must be >= 1"),
    (["train", "--config", CONFIG, "algorithm.eta_a=0.3"],
     "copc train: config error: algorithm.eta_a: moved to algorithm.estimator_settings.eta_a "
     "(with advantage_estimator: copc)"),
    (["train", "--config", CONFIG, "train.nope=1"],
     "copc train: config error: train.nope: Key 'nope' not in 'TrainConfig'"),
    (["train", "--config", CONFIG, "algorithm.policy_loss_settings.clip_high=0.3"],
     "copc train: config error: algorithm.policy_loss_settings.clip_high=0.3: unknown setting of "
     "DisSettings; known: ['eta_p', 'ppo_clip_eps'] (clip_high is a setting of policy_loss: ppo | "
     "decoupled_ppo | tis | icepop)"),
    (["train", "--config", CONFIG, "algorithm.estimator_settings.eta_a=2"],
     "copc train: config error: algorithm.estimator_settings.eta_a=2.0: must be a number in [0, 1]"),
    (["train", "--config", CONFIG, "rollout.engine=sglang", "rollout.engine_settings.port=0"],
     "copc train: config error: rollout.engine_settings.port=0: must be in 1..65535"),
    (["train", "--config", CONFIG, "learner.backend_settings.nope=1"],
     "copc train: config error: learner.backend_settings.nope=1: unknown setting of TorchSettings; known: "
     "['autocast_dtype', 'critic_freeze_attention', 'gradient_checkpointing', 'logprob_chunk_tokens', "
     "'shared_prefix_tokens']"),
    (["train", "--config", CONFIG, "learner.backend=megatron",
      "learner.backend_settings.pipeline_parallel_size=2"],
     "copc train: config error: learner.backend_settings.world_size=1: must be divisible by "
     "tensor_parallel_size × pipeline_parallel_size = 1 × 2"),
    (["train", "--config", CONFIG, "task.settings.nope=1"],
     "copc train: config error: task.settings.nope=1: unknown setting of MathToolSettings; known: "
     "['arithmetic_kinds', 'tool_use_fraction', 'warm_start_data']"),
    (["eval", "--config", CONFIG, "train.total_steps=0"],
     "copc eval: config error: train.total_steps=0: must be >= 1"),
]


def _copc(args: list[str]) -> tuple[int, list[str], str]:
    """``(exit code, heavy modules imported, stderr)`` of ``copc <args>`` in a fresh interpreter."""
    proc = subprocess.run([sys.executable, "-c", SCRIPT, *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    return result["rc"], result["heavy"], proc.stderr


@pytest.mark.parametrize(("args", "line"), CASES, ids=[" ".join(c[0][:1] + c[0][3:]) for c in CASES])
def test_config_error_is_one_line_before_torch(args, line):
    rc, heavy, err = _copc(args)
    assert (rc, err) == (2, line + "\n")
    assert heavy == []


def test_sweep_config_error_is_one_line_before_torch(tmp_path):
    rc, heavy, err = _copc(["sweep", "--config", CONFIG, "--grid", "train.total_steps=0,1",
                            "--out", str(tmp_path / "sweep"), "--dry-run"])
    assert (rc, err) == (2, "copc sweep: config error: cell total_steps0 (seed 0): train.total_steps=0: "
                            "must be >= 1\n")
    assert heavy == []
    assert not (tmp_path / "sweep").exists()
