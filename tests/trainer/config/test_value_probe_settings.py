"""``train.value_probes`` (copc.component_settings.ValueProbeSettings): parsed at load with one-line
errors naming the key, carried to the learner's algorithm (its pooled-probe window and weight cap)."""

from __future__ import annotations

from pathlib import Path

import pytest

from trainer.config import load_config
from trainer.config.specs import learner_config
from trainer.errors import ConfigError
from trainer.learner.algorithm import ActorCriticAlgorithm

CONFIG = Path(__file__).resolve().parents[3] / "configs" / "math_tool" / "cpu_tiny.yaml"


def test_the_window_and_cap_reach_the_algorithm():
    cfg = load_config(CONFIG, ["train.value_probes.window_steps=3", "train.value_probes.weight_cap=4.0"])
    step = learner_config(cfg)
    assert (step.value_probes.window_steps, step.value_probes.weight_cap) == (3, 4.0)
    algo = ActorCriticAlgorithm.from_config(cfg.algorithm_config(), step)
    assert algo.value_probe_window.steps.maxlen == 3 and algo.value_probes.weight_cap == 4.0
    assert learner_config(load_config(CONFIG)).value_probes.window_steps == 32  # the default


@pytest.mark.parametrize("override,needle", [
    ("train.value_probes.window_steps=0", "train.value_probes.window_steps=0: must be an int >= 1"),
    ("train.value_probes.weight_cap=-1", "train.value_probes.weight_cap=-1"),
    ("train.value_probes.bogus=1", "train.value_probes.bogus=1: unknown setting of ValueProbeSettings"),
])
def test_bad_values_are_one_line_naming_the_key(override, needle):
    with pytest.raises(ConfigError, match=needle.replace(".", r"\.")) as ei:
        load_config(CONFIG, [override])
    assert "\n" not in str(ei.value)
