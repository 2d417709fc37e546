"""Math reward: exact numeric equivalence (real math-verify) and the helper process's faults.

Fault 3 of issue 9: math-verify's absolute tolerance accepted wrong answers with tiny values;
fault 9: a dying answer-checking helper process made the step raise EOFError/BrokenPipeError.
"""

from __future__ import annotations

import multiprocessing.spawn
import os
import signal
import threading
from typing import Any

import pytest

from environments.errors import InfrastructureError
from environments.math_tool import MathReward, MathRewardConfig, MathToolEnv
from environments.math_tool.reward import exact_numeric_eq, verify_answer

# (gold, answer inside \boxed{}, expected correct)
PAIRS = [
    # the two pairs of the issue: tiny values that differ
    (r"\frac{1}{2^{99}}", r"\frac{1}{2^{98}}", False),
    (r"\frac{1}{2^{60}}", r"\frac{3}{2^{60}}", False),
    # more tiny, huge and sign differences: exact rationals compare exactly
    (r"-\frac{1}{2^{70}}", r"\frac{1}{2^{70}}", False),
    (r"10^{-30}", r"2\times 10^{-30}", False),
    (r"0", r"10^{-40}", False),
    (r"2^{100}", r"2^{100}+1", False),
    (r"10^{20}", r"10^{20}+1", False),
    (r"3^{1000}", r"3^{1000}-1", False),
    (r"3^{100000}", r"3^{100000}+1", False),
    (r"-5", r"5", False),
    # decimals: relative tolerance 1e-9, never absolute
    (r"1e-30", r"2e-30", False),
    (r"0.0000001", r"0.0000002", False),
    (r"0", r"1e-20", False),
    (r"\frac{1}{2^{98}}", r"1.5777218104420236e-30", False),
    (r"\frac{1}{3}", r"0.333333", False),
    (r"\pi", r"3.14159", False),
    (r"\frac{\sqrt{2}}{2}", r"0.7071", False),
    # exact irrationals: exact (difference indistinguishable from 0 at 300 digits)
    (r"2^{100}\sqrt{2}", r"2^{100}\sqrt{2}+1", False),
    (r"\frac{\sqrt{2}}{2^{60}}", r"\frac{3\sqrt{2}}{2^{60}}", False),
    (r"2i", r"3i", False),
    # tiny differences inside structures (numbers compared by the same rule everywhere)
    (r"(0, 2^{-60})", r"(0, 3\cdot 2^{-60})", False),
    (r"\{2^{-99}\}", r"\{2^{-98}\}", False),
    (r"x = 2^{-99}", r"x = 2^{-98}", False),
    (r"\frac{x}{2^{60}}", r"\frac{3x}{2^{60}}", False),
    (r"\begin{pmatrix}2^{-70}\\1\end{pmatrix}", r"\begin{pmatrix}2^{-69}\\1\end{pmatrix}", False),
    (r"50\%", r"0.5\%", False),
    (r"x+1", r"x+2", False),
    # true positives kept
    (r"\frac{1}{2}", r"0.5", True),
    (r"\frac12", r"\frac{2}{4}", True),
    (r"10^{-30}", r"1e-30", True),
    (r"\frac{1}{2^{99}}", r"2^{-99}", True),
    (r"\frac{1}{2^{99}}", r"1.5777218104420236e-30", True),
    (r"\frac{\sqrt{2}}{2}", r"\sqrt{2}/2", True),
    (r"\frac{\sqrt2}{2}", r"0.7071067811865476", True),
    (r"2\pi", r"6.283185307179586", True),
    (r"\frac{1}{3}", r"0.3333333333333333", True),
    (r"x+1", r"1+x", True),
    (r"0.5x", r"\frac{x}{2}", True),
    (r"(1,2)", r"(1,2)", True),
    (r"[1,2)", r"[1,2)", True),
    (r"(0, 2^{-60})", r"(0, \frac{1}{2^{60}})", True),
    (r"\{1,2\}", r"\{2,1\}", True),
    (r"\begin{pmatrix}2^{-70}\\1\end{pmatrix}", r"\begin{pmatrix}\frac{1}{2^{70}}\\1\end{pmatrix}",
     True),
    (r"3", r"3.0", True),
    (r"392", r"392.0", True),
    (r"1000", r"1,000", True),
    (r"2^{100}", r"1267650600228229401496703205376", True),
    (r"3^{100000}", r"3\cdot 3^{99999}", True),
    (r"50\%", r"50", True),
    (r"50\%", r"0.5", True),
    (r"x=3", r"3", True),
    (r"\sqrt{8}", r"2\sqrt{2}", True),
    (r"\sqrt{2}+\sqrt{3}", r"\sqrt{5+2\sqrt{6}}", True),
    (r"\ln 8", r"3\ln 2", True),
    (r"1.5\times 10^{-20}", r"\frac{3}{2}\cdot 10^{-20}", True),
    (r"0.1", r"\frac{1}{10}", True),
    (r"0", r"0.0", True),
    (r"1+i", r"i+1", True),
    (r"\text{Monday}", r"\text{Monday}", True),
]


@pytest.mark.parametrize(("gold", "pred", "expected"), PAIRS)
def test_equivalence_table_main_thread(gold, pred, expected):
    reward = MathReward()
    r, comps = reward(f"so the answer is $\\boxed{{{pred}}}$", gold)
    assert (r, comps["correct"], comps["verify_timeout"]) == (float(expected),
                                                              float(expected), 0.0)
    assert verify_answer(gold, pred, 5) is expected


def test_equivalence_table_worker_thread_helper_process():
    """The same table from a rollout-worker thread: checks run in the helper process."""
    reward = MathReward()
    got: dict[int, Any] = {}

    def work() -> None:
        for i, (gold, pred, _) in enumerate(PAIRS):
            got[i] = reward(f"\\boxed{{{pred}}}", gold)

    t = threading.Thread(target=work)
    t.start()
    t.join(300)
    try:
        assert not t.is_alive()
        wrong = [(PAIRS[i][0], PAIRS[i][1], got[i]) for i in range(len(PAIRS))
                 if got[i][0] != float(PAIRS[i][2])]
        assert wrong == []
        assert all(got[i][1]["verify_timeout"] == 0.0 for i in got)
        assert reward._helper.starts == 1
    finally:
        reward.close()


def test_exact_numeric_eq_leaves_symbols_and_restores_math_verify():
    from math_verify import grader
    from sympy import Rational, Symbol

    x = Symbol("x")
    assert exact_numeric_eq(Rational(1, 2**99), Rational(1, 2**98)) is False
    assert exact_numeric_eq(Rational(2, 4), Rational(1, 2)) is True
    assert exact_numeric_eq(x + 1, 1 + x) is True  # structurally equal
    assert exact_numeric_eq(x / 2**60, 3 * x / 2**60) is False  # left to symbolic check
    verify_answer("1", "1", 5)
    assert grader.sympy_numeric_eq is not exact_numeric_eq  # swapped back after the check


# -- helper process faults ---------------------------------------------------------------
class _KillAfterSend:
    """Wraps the helper's connection: SIGKILLs the helper right after the answer is sent."""

    def __init__(self, conn: Any, pid: int) -> None:
        self._conn, self._pid = conn, pid

    def send(self, obj: Any) -> None:
        self._conn.send(obj)
        os.kill(self._pid, signal.SIGKILL)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._conn, name)


def _sabotage(monkeypatch, helper, *, kill_first_n: int, before_send: bool = False) -> None:
    """Make the first ``kill_first_n`` helpers started die: right after the answer is sent
    (EOF while checking) or, with ``before_send``, right after start (BrokenPipe on send)."""
    real_start = helper._start

    def start() -> None:
        real_start()
        if helper.starts > kill_first_n:
            return
        if before_send:
            os.kill(helper._proc.pid, signal.SIGKILL)
            helper._proc.join(10)
            helper._proc.is_alive = lambda: True  # not noticed before the send
        else:
            helper._conn = _KillAfterSend(helper._conn, helper._proc.pid)

    monkeypatch.setattr(helper, "_start", start)


def _in_thread(fn, *args):
    out: dict[str, Any] = {}

    def work() -> None:
        try:
            out["value"] = fn(*args)
        except BaseException as e:  # the test inspects it
            out["error"] = e

    t = threading.Thread(target=work)
    t.start()
    t.join(180)
    assert not t.is_alive()
    return out


def test_helper_killed_while_checking_is_restarted_and_rechecks(monkeypatch):
    reward = MathReward()
    _sabotage(monkeypatch, reward._helper, kill_first_n=1)
    try:
        out = _in_thread(reward, "\\boxed{\\frac{2}{4}}", "0.5")
        assert out["value"][0] == 1.0 and out["value"][1]["verify_timeout"] == 0.0
        assert reward._helper.starts == 2
        out = _in_thread(reward, "\\boxed{\\frac{1}{2^{98}}}", "\\frac{1}{2^{99}}")
        assert out["value"][0] == 0.0 and reward._helper.starts == 2
    finally:
        reward.close()


def test_helper_dead_before_send_is_restarted_and_rechecks(monkeypatch):
    reward = MathReward()
    _sabotage(monkeypatch, reward._helper, kill_first_n=1, before_send=True)
    try:
        out = _in_thread(reward, "\\boxed{392.0}", "392")
        assert out["value"][0] == 1.0 and reward._helper.starts == 2
    finally:
        reward.close()


def test_helper_dying_between_calls_is_restarted_silently():
    reward = MathReward()
    try:
        assert _in_thread(reward, "\\boxed{0.5}", "\\frac{1}{2}")["value"][0] == 1.0
        proc = reward._helper._proc
        os.kill(proc.pid, signal.SIGKILL)
        proc.join(10)
        out = _in_thread(reward, "\\boxed{\\frac{3}{2^{60}}}", "\\frac{1}{2^{60}}")
        assert out["value"][0] == 0.0 and out["value"][1]["verify_timeout"] == 0.0
        assert reward._helper.starts == 2
    finally:
        reward.close()


def test_helper_dying_every_time_raises_infrastructure_error(monkeypatch):
    reward = MathReward()
    _sabotage(monkeypatch, reward._helper, kill_first_n=2)
    try:
        out = _in_thread(reward, "\\boxed{392.0}", "392")
        err = out["error"]
        assert isinstance(err, InfrastructureError)
        assert "died twice" in str(err) and "SIGKILL" in str(err)
        assert reward._helper.starts == 2
        # the machinery recovers: the next check starts a healthy helper
        assert _in_thread(reward, "\\boxed{392.0}", "392")["value"][0] == 1.0
    finally:
        reward.close()


def test_helper_that_cannot_start_raises_infrastructure_error(monkeypatch):
    reward = MathReward()
    try:
        # start the resource tracker with the real interpreter first, then break spawning
        assert _in_thread(reward, "\\boxed{1}", "1.0")["value"][0] == 1.0
        reward._helper.close()
        monkeypatch.setattr(multiprocessing.spawn, "_python_exe", "/nonexistent/python")
        err = _in_thread(reward, "\\boxed{1}", "1.0")["error"]
        assert isinstance(err, InfrastructureError) and "could not start" in str(err)
    finally:
        reward.close()


def test_overrunning_check_scores_incorrect_and_restarts_helper():
    """A pathological answer that overruns the deadline is the policy's fault: reward 0,
    verify_timeout = 1, the helper killed and restarted for the next answer."""
    reward = MathReward(MathRewardConfig(timeout_s=1))
    helper = reward._helper
    try:
        assert _in_thread(reward, "\\boxed{2}", "2.0")["value"][0] == 1.0  # warm helper
        helper.slack_s = -1.5  # deadline 0.5 s; math-verify's own timeouts take 1 s
        out = _in_thread(reward, "\\boxed{9^{9^{9^{9}}}}", "1")
        assert out["value"][0] == 0.0 and out["value"][1]["verify_timeout"] == 1.0
        assert helper._proc is None and helper.starts == 1
        helper.slack_s = 30.0
        assert _in_thread(reward, "\\boxed{2}", "2.0")["value"][0] == 1.0
        assert helper.starts == 2
    finally:
        reward.close()


def test_env_step_from_worker_thread_raises_infrastructure_error(sandbox, monkeypatch):
    env = MathToolEnv(sandbox=sandbox)
    _sabotage(monkeypatch, env.reward_fn._helper, kill_first_n=2)
    sample = {"id": "t1", "problem": "What is 17 * 23 + 1?", "answer": "392"}

    def episode() -> Any:
        env.reset(options={"sample": sample})
        return env.step("The answer is \\boxed{392.0}")

    try:
        err = _in_thread(episode)["error"]
        assert type(err) is InfrastructureError and "died twice" in str(err)
    finally:
        env.close()


@pytest.mark.parametrize("mode", ["math_verify", "dapo_strict"])
def test_empty_answer_never_matches(mode):
    """Issue 21 item 14: an empty ``\\boxed{}`` (or only whitespace) is never correct, not even
    against an empty or whitespace golden answer (``"" == ""`` used to score 1)."""
    reward = MathReward(MathRewardConfig(mode=mode))
    try:
        for gold, pred in [("", ""), (" ", ""), ("", "  "), ("5", ""), ("5", " ")]:
            assert reward.is_correct(gold, pred) is False, (gold, pred)
        assert reward(r"so \boxed{}", "")[0] == 0.0
        assert reward.is_correct("5", " 5 ") is True  # a real answer still matches
    finally:
        reward.close()
