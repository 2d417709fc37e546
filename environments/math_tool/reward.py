"""Math rewards: ``math-verify`` equivalence (default) or DAPO's strict string match.

``math_verify`` guards parsing/verification with ``signal.alarm`` timeouts, which only work
in the main thread. On the main thread we call it directly with its timeouts; from any
other thread (rollout workers) the check runs in a helper process (started once, on demand)
with a deadline, and a helper that overruns is killed and restarted; the answer then
scores as incorrect with component ``verify_timeout = 1``.
"""

from __future__ import annotations

import multiprocessing as mp
import threading
from dataclasses import dataclass
from typing import Any

MODES = ("math_verify", "dapo_strict")
_MAX_ANSWER_CHARS = 1000  # longer "answers" are not sent to sympy (pathological parses)


def extract_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` (or ``\\fbox{...}``) in ``text``, braces matched.

    Returns ``None`` when there is none or its braces are unbalanced.
    """
    best = None
    for tag in ("\\boxed", "\\fbox"):
        i = text.rfind(tag + "{")
        if i > (best[0] if best else -1):
            best = (i, len(tag) + 1)
    if best is None or best[0] < 0:
        return None
    start = best[0] + best[1]
    depth = 1
    for j in range(start, len(text)):
        c = text[j]
        if c == "{":
            depth += 1
        elif c == "}":
            depth -= 1
            if depth == 0:
                return text[start:j].strip()
    return None


def _verify_direct(gold: str, pred: str, timeout_s: int | None) -> bool:
    from math_verify import parse, verify

    g = parse(f"${gold}$", parsing_timeout=timeout_s)
    p = parse(f"$\\boxed{{{pred}}}$", parsing_timeout=timeout_s)
    if not g or not p:
        return False
    return bool(verify(g, p, timeout_seconds=timeout_s))


def _verify_server(conn: Any, timeout_s: int) -> None:  # pragma: no cover - child process
    while True:
        try:
            gold, pred = conn.recv()
        except EOFError:
            return
        try:
            ok = _verify_direct(gold, pred, timeout_s)
        except Exception:
            ok = False
        conn.send(ok)


class _VerifyProcess:
    """A helper process that runs ``math_verify`` on its own main thread (signal timeouts)."""

    def __init__(self, timeout_s: int) -> None:
        self.timeout_s = timeout_s
        self._lock = threading.Lock()
        self._proc: Any = None
        self._conn: Any = None

    def _start(self) -> None:
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(target=_verify_server, args=(child, self.timeout_s),
                                 daemon=True)
        self._proc.start()
        child.close()

    def verify(self, gold: str, pred: str) -> bool | None:
        """True/False, or ``None`` when the check overran ``2 * timeout_s + 30`` s."""
        with self._lock:
            if self._proc is None or not self._proc.is_alive():
                self._start()
            self._conn.send((gold, pred))
            # the first call also pays the helper's start-up and math_verify import
            if self._conn.poll(2 * self.timeout_s + 30):
                return bool(self._conn.recv())
            self.close()
            return None

    def close(self) -> None:
        """Kill the helper (restarted on the next call)."""
        if self._proc is not None:
            self._proc.kill()
            self._proc.join(5)
            self._conn.close()
        self._proc = self._conn = None


@dataclass(frozen=True)
class MathRewardConfig:
    """Reward settings.

    Attributes:
        mode: ``"math_verify"`` (symbolic equivalence of the last ``\\boxed{}`` with the
            ground truth) or ``"dapo_strict"`` (DAPO's strict mode: the last ``\\boxed{}``
            within the final 300 characters must equal the ground truth string exactly,
            after stripping whitespace).
        correct_reward / incorrect_reward: reward for a right / wrong (or missing) answer
            (DAPO uses 1 / -1).
        tool_call_bonus: optional shaping, added per executed tool call...
        tool_bonus_max: ...up to this total (0 disables shaping).
        bonus_only_if_correct: shaping only on correct answers (avoids rewarding tool spam).
        timeout_s: math_verify parse/verify timeout, seconds.
    """

    mode: str = "math_verify"
    correct_reward: float = 1.0
    incorrect_reward: float = 0.0
    tool_call_bonus: float = 0.0
    tool_bonus_max: float = 0.0
    bonus_only_if_correct: bool = True
    timeout_s: int = 5

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"MathRewardConfig.mode={self.mode!r}: must be one of {MODES}")
        if self.tool_call_bonus < 0 or self.tool_bonus_max < 0:
            raise ValueError("MathRewardConfig.tool_call_bonus / tool_bonus_max must be >= 0, "
                             f"got {self.tool_call_bonus!r} / {self.tool_bonus_max!r}")
        if not isinstance(self.timeout_s, int) or self.timeout_s < 1:
            raise ValueError(f"MathRewardConfig.timeout_s={self.timeout_s!r}: int >= 1")


class MathReward:
    """Scores a response (the model's text only) against a ground-truth answer string."""

    def __init__(self, config: MathRewardConfig | None = None) -> None:
        self.config = config or MathRewardConfig()
        self._helper = _VerifyProcess(self.config.timeout_s)

    def is_correct(self, gold: str, pred: str | None) -> bool | None:
        """Whether ``pred`` (content of ``\\boxed{}``) matches ``gold``; None on timeout."""
        if pred is None or len(pred) > _MAX_ANSWER_CHARS:
            return False
        if self.config.mode == "dapo_strict":
            return pred.strip() == gold.strip()
        if pred.strip() == gold.strip():
            return True
        if threading.current_thread() is threading.main_thread():
            try:
                return _verify_direct(gold, pred, self.config.timeout_s)
            except Exception:
                return False
        return self._helper.verify(gold, pred)

    def __call__(self, response: str, gold: str, successful_tool_calls: int = 0
                 ) -> tuple[float, dict[str, float]]:
        """(reward, components) for ``response`` (concatenated model turns, no tool output).

        Components: ``correct`` (0/1), ``has_answer`` (0/1), ``tool_bonus``,
        ``verify_timeout`` (0/1).
        """
        cfg = self.config
        text = response[-300:] if cfg.mode == "dapo_strict" else response
        pred = extract_boxed(text)
        ok = self.is_correct(str(gold), pred)
        correct = bool(ok)
        bonus = 0.0
        if cfg.tool_bonus_max > 0 and (correct or not cfg.bonus_only_if_correct):
            bonus = min(cfg.tool_call_bonus * successful_tool_calls, cfg.tool_bonus_max)
        reward = (cfg.correct_reward if correct else cfg.incorrect_reward) + bonus
        return reward, {"correct": float(correct), "has_answer": float(pred is not None),
                        "tool_bonus": bonus, "verify_timeout": float(ok is None)}

    def close(self) -> None:
        """Stop the helper process, if any."""
        self._helper.close()
