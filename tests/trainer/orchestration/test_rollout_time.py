"""Where rollout time goes: ``llm_s`` / ``env_s`` / ``other_s`` per episode (real sandbox, real
embedded engine with a scripted tiny model), their per-step sums, eval records and the plot."""

from __future__ import annotations

import asyncio
import time

import pytest
from scripted import scripted

from environments.math_tool import MathToolEnv
from trainer.engines.base import SamplingParams
from trainer.engines.embedded import EmbeddedEngine
from trainer.evaluate.kinds import make_kind
from trainer.evaluate.records import record_of
from trainer.orchestration.step_metrics import rollout_metrics
from trainer.outputs.plots import make_plots
from trainer.rollout.agent_loop import run_episode

pytestmark = pytest.mark.usefixtures("one_torch_thread")

SAMPLE = {"id": "m1", "problem": "What is 12345 * 6789?", "answer": "83810205"}


def actions(code_prefix: str) -> list[str]:
    """Two interpreter calls (each starting with ``code_prefix``) then the boxed answer."""
    return [f"Compute.\n<code>\n```python\n{code_prefix}x = 12345 * 6789\nx\n```\n</code>",
            f"Again.\n<code>\n```python\n{code_prefix}print(12345 * 6789)\n```\n</code>",
            "So the answer is \\boxed{83810205}."]


def turn_of(prompt_text: str) -> int:
    return prompt_text.count("\n</interpreter>")


class SlowModel:
    """The real engine, each ``generate`` preceded by ``delay_s`` of waiting (a slow server);
    ``inside_s`` is the time measured here around every call."""

    def __init__(self, engine: EmbeddedEngine, delay_s: float) -> None:
        self.engine, self.delay_s, self.inside_s = engine, delay_s, 0.0

    async def generate(self, ids, params):
        t = time.perf_counter()
        try:
            await asyncio.sleep(self.delay_s)
            return await self.engine.generate(ids, params)
        finally:
            self.inside_s += time.perf_counter() - t


def play(model_tok, sandbox, code_prefix: str = "", model_delay_s: float = 0.0):
    """One episode; returns (trajectory, wall seconds measured around run_episode); the
    trajectory's ``info["measured_generate_s"]`` is the time measured around the engine calls."""
    model, tok = model_tok
    env = MathToolEnv(sandbox=sandbox)

    async def main():
        eng = EmbeddedEngine(model, tok, logits_processor=scripted(tok, actions(code_prefix), turn_of))
        engine = SlowModel(eng, model_delay_s)
        t = time.perf_counter()
        tr = await run_episode(engine, env, tok, SAMPLE, SamplingParams(temperature=1.0, max_new_tokens=200))
        wall = time.perf_counter() - t
        await eng.close()
        tr.info["measured_generate_s"] = engine.inside_s
        return tr, wall

    return asyncio.run(main())


def test_slow_tool_shows_up_in_env_s_not_llm_s(model_tok, sandbox):
    """Two sandbox calls that each sleep 0.3 s add ~0.6 s to env_s and nothing to llm_s; the
    three parts add up to the episode's wall time."""
    play(model_tok, sandbox)  # warm the sandbox workers and the model
    fast, fast_wall = play(model_tok, sandbox)
    slow, slow_wall = play(model_tok, sandbox, code_prefix="import time\ntime.sleep(0.3)\n")
    for tr, wall in ((fast, fast_wall), (slow, slow_wall)):
        assert tr.finish_reason == "terminated" and tr.reward == 1.0 and tr.info["tool_calls"] == 2
        parts = [tr.info["llm_s"], tr.info["env_s"], tr.info["other_s"]]
        assert all(isinstance(p, float) and p >= 0 for p in parts)
        assert tr.info["llm_s"] > 0 and tr.info["env_s"] > 0
        assert sum(parts) == pytest.approx(wall, abs=0.02)
    extra_env = slow.info["env_s"] - fast.info["env_s"]
    assert 0.55 <= extra_env <= 0.85, (slow.info, fast.info)  # measured here: 0.60-0.62
    assert slow.info["env_s"] >= 0.6 and fast.info["env_s"] < 0.2
    # llm_s is the time inside the engine calls, nothing of the tool's sleep (which would add 0.6 s)
    for tr in (fast, slow):
        assert tr.info["llm_s"] == pytest.approx(tr.info["measured_generate_s"], abs=0.02), tr.info


def test_slow_model_shows_up_in_llm_s_not_env_s(model_tok, sandbox):
    """A 0.25 s wait before each of the 3 generate calls goes to llm_s, not to env_s."""
    play(model_tok, sandbox)
    fast, _ = play(model_tok, sandbox)
    slow, wall = play(model_tok, sandbox, model_delay_s=0.25)
    assert slow.info["llm_s"] >= 0.75  # the waits are inside generate
    assert slow.info["llm_s"] == pytest.approx(slow.info["measured_generate_s"], abs=0.02)
    assert slow.info["env_s"] < 0.2 and abs(slow.info["env_s"] - fast.info["env_s"]) < 0.1
    assert slow.info["llm_s"] + slow.info["env_s"] + slow.info["other_s"] == pytest.approx(wall, abs=0.02)


def test_step_sums_eval_records_and_plot(model_tok, sandbox, tmp_path):
    """Per-step metrics are sums over the step's episodes; eval records carry the episode's
    values; the end-of-run plots include rollout_time.png."""
    a, _ = play(model_tok, sandbox, code_prefix="import time\ntime.sleep(0.3)\n")
    b, _ = play(model_tok, sandbox)
    m = rollout_metrics([a, b], version=1)
    for k in ("llm_s", "env_s", "other_s"):
        assert m[f"time/rollout_{k}"] == pytest.approx(a.info[k] + b.info[k], abs=1e-12)
    assert m["time/rollout_env_s"] >= 0.6
    _, tok = model_tok
    rec = record_of(a, make_kind("math"), index=0, benchmark="b", tokenizer=tok).to_json()
    assert rec["env_s"] == pytest.approx(a.info["env_s"], abs=1e-6) and rec["env_s"] >= 0.6
    assert rec["llm_s"] == pytest.approx(a.info["llm_s"], abs=1e-6)
    assert rec["other_s"] == pytest.approx(a.info["other_s"], abs=1e-6)
    paths = make_plots([{"step": 1, **m}, {"step": 2, **m}], tmp_path)
    assert tmp_path / "rollout_time.png" in paths
    assert (tmp_path / "rollout_time.png").stat().st_size > 5000
