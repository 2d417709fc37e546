"""examples/minimal_copc.py runs: synchronous COPC with the public API, on a tiny model (CPU, ~30 s)."""

from __future__ import annotations

import importlib.util
import math
import sys
from pathlib import Path

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "minimal_copc.py"


def _load():
    spec = importlib.util.spec_from_file_location("minimal_copc", EXAMPLE)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["minimal_copc"] = mod
    spec.loader.exec_module(mod)
    return mod


example = _load()


def test_the_environment_rewards_the_sum_and_runs_the_tool():
    env = example.AdditionEnv([{"id": 0, "a": 2, "b": 3}])
    obs, _ = env.reset(options={"sample": {"id": 0, "a": 2, "b": 3}})
    assert obs.startswith("What is 2+3?")
    obs, reward, terminated, _, info = env.step("<calc>2+3</calc>")
    assert obs == "<result>5</result>" and reward == 0.0 and not terminated and info["tool"] == "calc"
    _, reward, terminated, _, info = env.step("<answer>5</answer>")
    assert terminated and reward == 1.1 and info["reward_components"] == {"correct": 1.0, "digit": 1.0}
    assert example.CalcTool().run("1+x") == "error: '1+x' is not a sum of integers"


def test_minimal_copc_trains_and_syncs_the_engine(tmp_path):
    history = example.main(["--steps", "2", "--prompts", "2", "--group", "2", "--out", str(tmp_path)])
    assert [m["policy_version"] for m in history] == [1, 2]
    assert [m["engine_version"] for m in history] == [1, 2]  # the engine got each update's weights
    for m in history:
        assert m["staleness/max"] == 0.0  # synchronous: every token from the current policy
        assert math.isfinite(m["actor/pg_loss"]) and math.isfinite(m["critic/value_loss"])
        assert m["actor/updated"] == 1.0
        # rewards are sums of the env's components: 1.0 (right answer) and 0.1 (a digit)
        assert any(abs(m["reward"] * 4 - k * 0.1 - j) < 1e-9 for k in range(5) for j in range(5))
    # the digit bonus arrives, so rewards differ and the actor and critic get a gradient
    assert max(m["reward"] for m in history) > 0
    assert max(m["actor/grad_norm"] for m in history) > 0 and max(m["critic/grad_norm"] for m in history) > 0
