"""Scripted ReTool episodes (real sandbox, real math-verify) and math reward functions."""

from __future__ import annotations

import threading

import pytest

from environments.base import EnvLimits
from environments.math_tool import (
    MathReward,
    MathRewardConfig,
    MathToolEnv,
    extract_boxed,
    load_math,
    print_last_expression,
)

SAMPLE = {"id": "t1", "problem": "What is 17 * 23 + 1?", "answer": "392"}


def code(src: str) -> str:
    return f"I will compute.\n<code>\n```python\n{src}\n```\n</code>"


@pytest.fixture
def env(sandbox):
    e = MathToolEnv(sandbox=sandbox)
    yield e
    e.close()


def test_correct_episode_with_two_code_calls(env):
    obs, info = env.reset(options={"sample": SAMPLE})
    assert SAMPLE["problem"] in obs and "\\boxed{}" in obs and info["turn"] == 0
    obs, r, term, trunc, info = env.step(code("a = 17 * 23\na"))
    assert obs == "\n<interpreter>\n391\n</interpreter>\n"
    assert (r, term, trunc, info["tool_calls"], info["tool"]) == (0.0, False, False, 1, "python")
    obs, r, term, trunc, info = env.step(code("print(a + 1)"))  # fresh process: no state
    assert "NameError" in obs and info["tool_calls"] == 2
    obs, r, term, trunc, info = env.step(code("print(17 * 23 + 1)"))
    assert "392" in obs
    obs, r, term, trunc, info = env.step("So the answer is $\\boxed{392}$.")
    assert (obs, r, term, trunc) == ("", 1.0, True, False)
    assert info["final_answer"] == "392" and info["turn"] == 4 and info["tool_calls"] == 3
    assert info["reward_components"]["correct"] == 1.0


def test_equivalent_latex_answer_is_correct(env):
    env.reset(options={"sample": {"id": "f", "problem": "half", "answer": "\\frac{1}{2}"}})
    _, r, term, _, _ = env.step("The answer is \\boxed{0.5}")
    assert term and r == 1.0


def test_wrong_answer(env):
    env.reset(options={"sample": SAMPLE})
    env.step(code("print(17 * 23)"))
    _, r, term, trunc, info = env.step("Therefore \\boxed{391}.")
    assert (r, term, trunc, info["final_answer"]) == (0.0, True, False, "391")


def test_tool_output_is_never_scored(env):
    env.reset(options={"sample": SAMPLE})
    obs, *_ = env.step(code("print('\\\\boxed{392}')"))
    assert "\\boxed{392}" in obs
    _, r, term, _, info = env.step("I am not sure.")  # no answer in the model's own text
    assert term and r == 0.0 and info["final_answer"] is None and info["invalid"]


def test_malformed_and_unclosed_tags(env):
    env.reset(options={"sample": SAMPLE})
    # unclosed code block: no tool call; no boxed answer either -> episode ends, reward 0
    _, r, term, _, info = env.step("<code>\n```python\nprint(392)\n")
    assert term and r == 0.0 and info["invalid"] and info["tool_calls"] == 0
    env.reset(options={"sample": SAMPLE})
    _, r, term, _, info = env.step("answer \\boxed{392")  # unbalanced braces
    assert term and r == 0.0 and info["final_answer"] is None


def test_more_turns_than_allowed(sandbox):
    env = MathToolEnv(sandbox=sandbox, limits=EnvLimits(max_turns=2, max_tool_calls=5))
    env.reset(options={"sample": SAMPLE})
    _, _, term, trunc, _ = env.step(code("print(1)"))
    assert not term and not trunc
    obs, r, term, trunc, info = env.step(code("print(2)"))
    assert (obs, r, term, trunc, info["turn"]) == ("", 0.0, False, True, 2)
    with pytest.raises(RuntimeError, match="after the episode ended"):
        env.step("\\boxed{392}")


def test_tool_call_limit_and_observation_truncation(sandbox):
    env = MathToolEnv(sandbox=sandbox, limits=EnvLimits(max_turns=5, max_tool_calls=1,
                                                         max_observation_chars=200))
    env.reset(options={"sample": SAMPLE})
    obs, *_ = env.step(code("print('y' * 5000)"))
    assert len(obs) <= 200 and "[truncated" in obs and obs.startswith("\n<interpreter>")
    obs, _, _, _, info = env.step(code("print(1)"))
    assert "limit of 1 reached" in obs and info["invalid"] and info["tool_calls"] == 1


def test_sandbox_failures_rendered(env):
    env.reset(options={"sample": SAMPLE})
    obs, *_ = env.step(code("1/0"))
    assert "ZeroDivisionError: division by zero" in obs
    obs, *_ = env.step(code("while True: pass").replace("I will", "x"))
    # default code_timeout_s is 10 s; use a fast one instead
    env2 = MathToolEnv(sandbox=env.sandbox, code_timeout_s=0.5)
    env2.reset(options={"sample": SAMPLE})
    obs, *_ = env2.step(code("while True: pass"))
    assert "timeout" in obs


def test_print_last_expression():
    assert print_last_expression("x = 2\nx * 3").endswith("print(repr(__copc_last__) if not "
                                                         "isinstance(__copc_last__, str) else "
                                                         "__copc_last__)")
    assert print_last_expression("print(1)") == "print(1)"
    assert print_last_expression("x = 1") == "x = 1"
    assert print_last_expression("def (") == "def ("


def test_extract_boxed():
    assert extract_boxed("a \\boxed{1} b \\boxed{\\frac{1}{2}} c") == "\\frac{1}{2}"
    assert extract_boxed("\\fbox{7}") == "7"
    assert extract_boxed("no answer") is None
    assert extract_boxed("\\boxed{1") is None


def test_dapo_strict_and_shaping():
    strict = MathReward(MathRewardConfig(mode="dapo_strict", incorrect_reward=-1.0))
    assert strict("\\boxed{392}", "392")[0] == 1.0
    assert strict("\\boxed{392.0}", "392")[0] == -1.0  # math-verify would accept this
    assert strict("\\boxed{392}" + "x" * 400, "392")[0] == -1.0  # only the last 300 chars
    shaped = MathReward(MathRewardConfig(tool_call_bonus=0.1, tool_bonus_max=0.25))
    r, comps = shaped("\\boxed{392}", "392", successful_tool_calls=5)
    assert r == pytest.approx(1.25) and comps["tool_bonus"] == pytest.approx(0.25)
    assert shaped("\\boxed{1}", "392", successful_tool_calls=5)[0] == 0.0
    with pytest.raises(ValueError, match="mode='exact'"):
        MathRewardConfig(mode="exact")


def test_math_verify_off_main_thread():
    reward = MathReward()
    out = {}

    def work() -> None:
        out["eq"] = reward("\\boxed{\\frac{2}{4}}", "0.5")
        out["ne"] = reward("\\boxed{3}", "0.5")

    t = threading.Thread(target=work)
    t.start()
    t.join(120)
    reward.close()
    assert out["eq"][0] == 1.0 and out["ne"][0] == 0.0
    assert out["eq"][1]["verify_timeout"] == 0.0


def test_data_loaders():
    rows = load_math("aime2025")
    assert len(rows) == 30 and rows[0]["id"].startswith("aime2025")
    first = next(r for r in rows if r["id"] == "aime2025-I-1")
    assert first["answer"] == "70"
    assert len(load_math("math500", limit=5)) == 5
    assert len(load_math("aime2024")) == 30 and len(load_math("math_train", limit=3)) == 3
    with pytest.raises(FileNotFoundError, match=r"nope\.jsonl"):
        load_math("nope.jsonl")


def test_bad_jsonl_line_reported(tmp_path):
    p = tmp_path / "bad.jsonl"
    p.write_text('{"id": "a", "problem": "p", "answer": "1"}\n{"id": "b", "problem": "q"}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2: missing field\(s\) \['answer'\]"):
        load_math(str(p))


def test_env_from_dataset_seeded_reset(sandbox):
    env = MathToolEnv(sandbox=sandbox, dataset="aime2025")
    a, ia = env.reset(seed=3)
    b, ib = env.reset(seed=3)
    assert a == b and ia["sample_id"] == ib["sample_id"]
