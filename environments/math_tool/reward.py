"""Math rewards: ``math-verify`` equivalence with exact numbers (default) or DAPO's strict match.

Equivalence rule (mode ``math_verify``). Both answers are parsed by ``math-verify`` (LaTeX →
sympy) and compared by its ``verify`` — string match, sets, intervals, tuples, equations,
matrices, symbolic simplification — except that every comparison of two *numbers* (at the top
level or inside a set, interval, tuple, equation or matrix) uses our rule instead of
math-verify's tolerances. Those tolerances are absolute: ``(a - b).evalf(chop=True)`` drops a
difference below about 1e-17 and decimals are rounded to 6 places, so ``\\frac{1}{2^{98}}``
"equalled" ``\\frac{1}{2^{99}}`` and ``0.0000002`` "equalled" ``0.0000001``. Our rule:

1. both values exact rationals (integers, fractions, powers with integer exponents, e.g.
   ``\\frac{1}{2^{99}}``, ``2^{100}+1``; no decimal point anywhere): equal iff exactly equal.
2. both values exact but not both rational (``\\frac{\\sqrt2}{2}``, ``2\\pi``, ``1+i``): equal
   iff their difference is 0 or sympy cannot tell it from 0: ``evalf(strict=True)`` with up
   to 300 digits of working precision computes no significant digit of it (sympy raises its
   precision on cancellation, so a non-zero difference such as ``2^{100}\\sqrt2 + 1`` vs
   ``2^{100}\\sqrt2`` comes out accurately). Exact values beyond ``10^(±100000)`` are not
   evaluated (no cost bound) and go to math-verify's exact symbolic check (rule 5).
3. a decimal literal on either side (``0.25``, ``3.0``, ``6.283185307179586``, ``1e-30``):
   a decimal is read as an approximation, equal iff
   ``|a - b| <= 1e-9 * max(|a|, |b|)`` (:data:`REL_TOL_DECIMAL`). Why 1e-9: a float printed
   by Python (what a ReTool model copies from ``<interpreter>``) has 16-17 significant digits
   and float64 arithmetic keeps errors far below 1e-9 for any computation a solution does, so
   ``0.3333333333333333`` for ``\\frac13`` and ``6.283185307179586`` for ``2\\pi`` are right;
   a hand-rounded ``0.7071`` for ``\\frac{\\sqrt2}{2}`` or ``3.14159`` for ``\\pi`` is wrong.
   The tolerance is relative, so it never makes tiny values equal: ``1e-30`` vs ``2e-30`` is
   wrong, and any non-zero value differs from ``0``.
4. a percentage ``p\\%`` equals a number equal to ``p/100`` or to ``p`` (math-verify's reading).
5. anything with a free variable (``x+1`` vs ``1+x``) is left to math-verify's exact symbolic
   check (``simplify(a - b) == 0``), text to its string match.

A whole answer in plain scientific notation with a lower-case ``e`` (``1e-30``, as Python
prints it) is read as that number: math-verify alone reads it as ``1·e − 30`` (Euler's e).

Threads. ``math_verify`` guards parsing/verification with ``signal.alarm`` timeouts, which only
work in the main thread. On the main thread we call it directly with its timeouts; from any
other thread (rollout workers) the check runs in a helper process (started once, on demand)
with a deadline. A helper that overruns is killed and restarted; the answer then scores as
incorrect with component ``verify_timeout = 1`` (a pathological answer is the policy's fault).
A helper that dies (killed, crashed) is restarted and the answer checked once more; if that
fails too, or the helper cannot start, :class:`~environments.errors.InfrastructureError` is
raised — the episode is an infrastructure failure, never a wrong answer.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import re
import signal
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from ..errors import InfrastructureError

MODES = ("math_verify", "dapo_strict")
_MAX_ANSWER_CHARS = 1000  # longer "answers" are not sent to sympy (pathological parses)

#: Relative tolerance when a decimal literal takes part in a numeric comparison (rule 3).
REL_TOL_DECIMAL = 1e-9
_EVAL_DIGITS = 60  # significant digits of a numeric evaluation
_MAX_EVAL_DIGITS = 300  # rule 2: working precision (digits) before a difference counts as 0
_MAX_EXACT_EXPONENT = 100_000  # exact evaluation only for |value| within 10^(±100000)
_SCI_NOTATION = re.compile(r"^\s*([+-]?(?:\d+\.?\d*|\.\d+))e([+-]?\d+)\s*$")


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


# -- exact numeric comparison ----------------------------------------------------------------
def _doit(e: Any) -> Any:
    """``e`` evaluated (``UnevaluatedExpr`` wrappers, e.g. of percentages, removed)."""
    from sympy import UnevaluatedExpr

    try:
        wrapped = e.atoms(UnevaluatedExpr)
        if wrapped:
            e = e.xreplace({w: w.args[0] for w in wrapped})
        return e.doit()
    except Exception:
        return e


def _percent_of(e: Any) -> Any:
    """``p`` for math-verify's percentage ``Mul(p, UnevaluatedExpr(1/100))``, else ``None``."""
    from sympy import Mul, Rational, UnevaluatedExpr

    if isinstance(e, Mul) and len(e.args) == 2 and e.args[1] == UnevaluatedExpr(Rational(1, 100)):
        return e.args[0]
    return None


def _magnitude_ok(e: Any) -> bool:
    """Whether ``|e|`` is 0 or within ``10^(±100000)``, from a 15-digit estimate (cheap even
    for ``3^{10^9}``), so that evaluating ``e`` exactly stays cheap (well under a second)."""
    from sympy import log

    try:
        v = abs(e.evalf(15))
        return bool(v == 0 or abs(log(v, 10).evalf(15)) <= _MAX_EXACT_EXPONENT)
    except Exception:
        return False


def _indistinguishable_from_zero(d: Any) -> bool:
    """Rule 2: ``d`` (an exact number) is 0, or sympy cannot tell it from 0 at
    ``_MAX_EVAL_DIGITS`` digits of working precision (``evalf(strict=True)`` raises
    ``PrecisionExhausted`` exactly when no significant digit of ``d`` can be computed)."""
    from sympy.core.evalf import PrecisionExhausted

    try:
        v = d.evalf(_EVAL_DIGITS, strict=True, maxn=_MAX_EVAL_DIGITS)
    except PrecisionExhausted:
        return True
    return bool(v == 0)


def _numbers_equal(a: Any, b: Any) -> bool:
    """Rules 1-3 of the module docstring for two sympy values; False unless both are numbers
    (no free symbols), so symbolic expressions go on to math-verify's exact symbolic check.
    Never raises (a comparison sympy cannot make is False)."""
    from sympy import Expr, Float

    try:
        if not (isinstance(a, Expr) and isinstance(b, Expr)):
            return False
        if a == b:
            return True
        small = _magnitude_ok(a) and _magnitude_ok(b)
        a_num, b_num = (_doit(a), _doit(b)) if small else (a, b)
        if not (isinstance(a_num, Expr) and isinstance(b_num, Expr)
                and a_num.is_number and b_num.is_number):
            return False
        if any(x.has(Float) for x in (a, b, a_num, b_num)):  # rule 3
            diff = abs((a_num - b_num).evalf(_EVAL_DIGITS))
            scale = max(abs(a_num.evalf(_EVAL_DIGITS)), abs(b_num.evalf(_EVAL_DIGITS)))
            return bool(diff.is_finite and scale.is_finite and diff <= REL_TOL_DECIMAL * scale)
        if not small:  # exact and huge: left to math-verify's exact symbolic check
            return False
        if a_num.is_Rational and b_num.is_Rational:  # rule 1
            return bool(a_num == b_num)
        return _indistinguishable_from_zero(a_num - b_num)  # rule 2
    except Exception:
        return False


def exact_numeric_eq(a: Any, b: Any, float_rounding: int = 6, numeric_precision: int = 15) -> bool:
    """Our replacement for ``math_verify.grader.sympy_numeric_eq`` (same signature).

    ``a``, ``b``: sympy expressions or matrices (gold, prediction). True iff they are equal
    numbers under rules 1-4 of the module docstring (matrices: same shape, entrywise).
    ``float_rounding`` / ``numeric_precision`` (math-verify's absolute tolerances) are ignored.
    Never raises (a failing comparison is False, as in math-verify).
    """
    from sympy import MatrixBase
    from sympy.matrices.expressions import MatrixExpr

    if isinstance(a, (MatrixBase, MatrixExpr)) or isinstance(b, (MatrixBase, MatrixExpr)):
        a, b = _doit(a), _doit(b)
        try:
            return (isinstance(a, MatrixBase) and isinstance(b, MatrixBase)
                    and a.shape == b.shape
                    and all(exact_numeric_eq(x, y) for x, y in zip(a, b, strict=True)))
        except Exception:
            return False
    if _numbers_equal(a, b):
        return True
    pa, pb = _percent_of(a), _percent_of(b)
    if (pa is None) != (pb is None):  # rule 4: "50\\%" also reads as the number 50
        return _numbers_equal(a if pa is None else pa, b if pb is None else pb)
    return False


_PATCH_LOCK = threading.RLock()


@contextlib.contextmanager
def _exact_numbers() -> Iterator[None]:
    """Within the block, math-verify compares numbers with :func:`exact_numeric_eq`.

    math-verify calls the module global ``grader.sympy_numeric_eq`` for every numeric
    comparison (top level and inside sets, intervals, tuples, relations, matrices); it is
    swapped for the duration of one ``verify`` call and restored after.

    Raises:
        InfrastructureError: the installed math-verify has no ``grader.sympy_numeric_eq``
            (written against math-verify 0.9.0).
    """
    from math_verify import grader

    if not callable(getattr(grader, "sympy_numeric_eq", None)):
        raise InfrastructureError(
            "math-verify reward checker: the installed math_verify has no "
            "grader.sympy_numeric_eq to replace (written against math-verify 0.9.0)")
    with _PATCH_LOCK:
        saved = grader.sympy_numeric_eq
        grader.sympy_numeric_eq = exact_numeric_eq
        try:
            yield
        finally:
            grader.sympy_numeric_eq = saved


def _normalise(answer: str) -> str:
    """``1e-30`` → ``1E-30`` (latex2sympy's own scientific notation; with a lower-case ``e``
    it reads Euler's number). Other answers are returned unchanged."""
    m = _SCI_NOTATION.match(answer)
    return f"{m.group(1)}E{m.group(2)}" if m else answer


def verify_answer(gold: str, pred: str, timeout_s: int | None) -> bool:
    """Whether ``pred`` (content of a ``\\boxed{}``) equals ``gold`` under the module's rule.

    Must run on a thread that may use ``signal.alarm`` (the main thread) when ``timeout_s``
    is set: math-verify's parse and verify timeouts, in seconds; an overrun counts as False.

    Raises:
        InfrastructureError: math-verify cannot be imported or lacks what the rule needs.
    """
    try:
        from math_verify import parse, verify
    except ImportError as e:
        raise InfrastructureError(f"math-verify reward checker: cannot import math_verify: "
                                  f"{e}") from e
    g = parse(f"${_normalise(gold)}$", parsing_timeout=timeout_s)
    p = parse(f"$\\boxed{{{_normalise(pred)}}}$", parsing_timeout=timeout_s)
    if not g or not p:
        return False
    with _exact_numbers():
        return bool(verify(g, p, timeout_seconds=timeout_s))


# -- helper process (checks from non-main threads) ---------------------------------------------
def _verify_server(conn: Any, timeout_s: int) -> None:  # pragma: no cover - child process
    """Helper main loop: ``(gold, pred)`` in; ``("ok", bool)`` or ``("error", message)`` out."""
    while True:
        try:
            gold, pred = conn.recv()
        except EOFError:
            return
        try:
            reply: tuple[str, Any] = ("ok", verify_answer(gold, pred, timeout_s))
        except InfrastructureError as e:
            reply = ("error", str(e))
        except Exception:
            reply = ("ok", False)
        conn.send(reply)


class _VerifyProcess:
    """A helper process that runs ``math_verify`` on its own main thread (signal timeouts).

    Started on the first :meth:`verify`; restarted silently when found dead before a check.
    ``starts`` counts the helpers started so far. A check may take ``2 * timeout_s +
    slack_s`` seconds (math-verify's parse and verify timeouts, plus the first call's start-up
    and import) before it counts as overrun.
    """

    slack_s: float = 30.0

    def __init__(self, timeout_s: int) -> None:
        self.timeout_s = timeout_s
        self.starts = 0
        self._lock = threading.Lock()
        self._proc: Any = None
        self._conn: Any = None

    def _start(self) -> None:
        """Start a helper.

        Raises:
            InfrastructureError: the process could not be started (spawn failed).
        """
        ctx = mp.get_context("spawn")
        conn, child = ctx.Pipe()
        proc = ctx.Process(target=_verify_server, args=(child, self.timeout_s), daemon=True,
                           name="copc-math-verify")
        try:
            proc.start()
        except Exception as e:
            conn.close()
            raise InfrastructureError(f"math-verify helper process could not start: "
                                      f"{type(e).__name__}: {e}") from e
        finally:
            child.close()
        self.starts += 1
        self._proc, self._conn = proc, conn

    def _describe_death(self, stage: str, err: BaseException) -> str:
        """Reap the dead helper and say what happened (pid, exit code, the pipe error)."""
        proc = self._proc
        pid = proc.pid if proc is not None else None
        code = None
        if proc is not None:
            proc.join(5)
            code = proc.exitcode
        self.close()
        if code is not None and code < 0:
            try:
                how = f"killed by {signal.Signals(-code).name}"
            except ValueError:
                how = f"killed by signal {-code}"
        else:
            how = f"exit code {code}"
        return (f"helper pid {pid} died {stage} ({how}; "
                f"{type(err).__name__}: {str(err) or 'connection closed'})")

    def verify(self, gold: str, pred: str) -> bool | None:
        """Check one answer in the helper: True/False, or ``None`` when the check overran
        ``2 * timeout_s + slack_s`` s (helper killed; restarted on the next call).

        A helper that dies (before the answer is sent: BrokenPipe; while checking: EOF) is
        restarted and the answer checked once more.

        Raises:
            InfrastructureError: the helper died twice in this call, could not be started,
                or reported that math-verify is unusable.
        """
        with self._lock:
            failures: list[str] = []
            while True:
                if self._proc is None or not self._proc.is_alive():
                    self.close()  # died between calls (or never started): restart silently
                    self._start()
                stage = "before the answer was sent"
                try:
                    self._conn.send((gold, pred))
                    stage = "while checking an answer"
                    if not self._conn.poll(2 * self.timeout_s + self.slack_s):
                        self.close()
                        return None
                    status, value = self._conn.recv()
                except (EOFError, OSError) as e:
                    failures.append(self._describe_death(stage, e))
                    if len(failures) >= 2:
                        raise InfrastructureError(
                            "math-verify helper process died twice checking one answer: "
                            + "; then restarted, ".join(failures)) from e
                    continue
                if status == "error":
                    raise InfrastructureError(value)
                return bool(value)

    def close(self) -> None:
        """Kill the helper (restarted on the next call)."""
        if self._proc is not None:
            self._proc.kill()
            self._proc.join(5)
        if self._conn is not None:
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
        for name in ("correct_reward", "incorrect_reward", "tool_call_bonus", "tool_bonus_max"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int | float):
                raise ValueError(f"MathRewardConfig.{name}={v!r}: must be a number")
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
        """Whether ``pred`` (content of ``\\boxed{}``) matches ``gold``; None on timeout.

        Rule: the module docstring (``math_verify`` mode) or exact string match after
        stripping whitespace (``dapo_strict``); an empty or whitespace-only ``pred`` is never
        correct. On the main thread math-verify runs here,
        elsewhere in the helper process.

        Raises:
            InfrastructureError: the checker failed (helper died twice or cannot start,
                math-verify unusable) — not the policy's fault, not a wrong answer.
        """
        if pred is None or len(pred) > _MAX_ANSWER_CHARS or not pred.strip():
            return False  # an empty answer never matches (not even an empty golden answer)
        if self.config.mode == "dapo_strict":
            return pred.strip() == gold.strip()
        if pred.strip() == gold.strip():
            return True
        if threading.current_thread() is threading.main_thread():
            try:
                return verify_answer(gold, pred, self.config.timeout_s)
            except InfrastructureError:
                raise
            except Exception:
                return False
        return self._helper.verify(gold, pred)

    def __call__(self, response: str, gold: str, successful_tool_calls: int = 0
                 ) -> tuple[float, dict[str, float]]:
        """(reward, components) for ``response`` (concatenated model turns, no tool output).

        Components: ``correct`` (0/1), ``has_answer`` (0/1), ``tool_bonus``,
        ``verify_timeout`` (0/1).

        Raises:
            InfrastructureError: see :meth:`is_correct`.
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
