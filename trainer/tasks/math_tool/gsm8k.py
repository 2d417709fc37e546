"""``gsm8k_solutions`` warm-start traces: GSM8K training solutions turned into ReTool tool calls.

A GSM8K reference solution (Cobbe et al. 2021, arXiv:2110.14168) is a few sentences whose every
calculation carries a calculator annotation, e.g.::

    Natalia sold 48/2 = <<48/2=24>>24 clips in May.
    Natalia sold 48+24 = <<48+24=72>>72 clips altogether in April and May.
    #### 72

Those annotations are exactly the arithmetic a tool call would do. :func:`gsm8k_code` turns the
solution into one Python ``<code>`` call (ReTool's format, Feng et al. 2025, arXiv:2504.11536):
each sentence with a calculation becomes a comment (the sentence, annotations removed) followed by
``print(<expression>)`` for each of its calculations, so the last line printed is the final
calculation. :func:`gsm8k_traces` plays each one through the REAL ``MathToolEnv`` (the sandbox runs
the code; turn 2 copies the last printed line into ``The answer is $\\boxed{...}$.``) and keeps the
traces the environment scores correct: a solution whose last calculation is not its answer (the
answer is a sentence's plain number, or a unit conversion happens in the text) gives no trace and
is counted, not raised.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from ...warmstart.traces import Trace, TraceError, play_traces
from .traces import _INTERPRETER, _play

log = logging.getLogger(__name__)

#: A calculator annotation ``<<expression=result>>``.
_CALC = re.compile(r"<<([^<>=]+)=([^<>]*)>>")
#: What a calculation may contain to be run as Python (digits, operators, parentheses, dots).
_PYTHON_ARITHMETIC = re.compile(r"^[\d\s.+\-*/()%]+$")


def gsm8k_code(solution: str) -> str | None:
    """The Python program of a GSM8K solution (module docstring), or None when it has no
    calculation or one that is not plain arithmetic (e.g. ``<<2^3=8>>``: ``^`` is XOR in Python).

    Args:
        solution: the reference solution, ``#### answer`` last.

    Returns:
        Lines ``# <sentence>`` and ``print(<expression>)``, newline-joined.
    """
    lines: list[str] = []
    for sentence in solution.split("\n"):
        if sentence.startswith("####"):
            break
        calcs = _CALC.findall(sentence)
        if not calcs:
            continue
        if not all(_PYTHON_ARITHMETIC.match(expr) for expr, _ in calcs):
            return None
        lines.append("# " + _CALC.sub("", sentence).strip())
        lines += [f"print({expr.strip()})" for expr, _ in calcs]
    return "\n".join(lines) if lines else None


def gsm8k_code_action(code: str) -> str:
    """Turn 1: the ``<code>`` call of the few-shot prompt's format."""
    return f"<code>\n```python\n{code}\n```\n</code>"


def answer_action(value: str) -> str:
    """Turn 2: ``The answer is $\\boxed{value}$.`` (the few-shot prompt's closing sentence)."""
    return f"The answer is $\\boxed{{{value}}}$."


def _last_printed(observation: str) -> str:
    """The last non-empty line inside the observation's ``<interpreter>`` block.

    Raises:
        TraceError: no ``<interpreter>`` block, or nothing printed.
    """
    m = _INTERPRETER.search(observation)
    lines = [x.strip() for x in (m.group(1).splitlines() if m else []) if x.strip()]
    if not lines:
        raise TraceError(f"no printed value in the observation {observation!r}")
    return lines[-1]


def gsm8k_traces(samples: Sequence[Mapping[str, Any]], env_factory: Callable[[], Any], *,
                 progress: bool = False) -> tuple[list[Trace], int]:
    """Warm-start traces of GSM8K rows, each played through a real ``MathToolEnv``.

    Args:
        samples: rows ``{"id", "problem", "answer", "solution"}`` (``data/gsm8k_train.jsonl``).
        env_factory: ``() -> MathToolEnv`` (the task's, with its prompt and shared sandbox).
        progress: show a tqdm bar.

    Returns:
        ``(traces, skipped)``: one :class:`Trace` (``action, observation, action``) per row whose
        program ran and whose last printed value the environment scored correct, in order; and
        how many rows gave none (no program, or a wrong last value).
    """
    usable = [(s, code) for s in samples if (code := gsm8k_code(str(s.get("solution", "")))) is not None]
    skipped = [len(samples) - len(usable)]

    def play(env: Any, row: tuple[Mapping[str, Any], str]) -> Trace | None:
        sample, code = row
        try:
            return _play(env, sample, gsm8k_code_action(code), lambda obs: answer_action(_last_printed(obs)))
        except TraceError:  # the last calculation is not the answer: no trace of this row
            skipped[0] += 1
            return None

    traces = play_traces(usable, env_factory, play, progress=progress, desc="gsm8k traces")  # drops None
    log.info("gsm8k_solutions warm-start: %d traces from %d rows (%d without a usable program)",
             len(traces), len(samples), skipped[0])
    return traces, skipped[0]


__all__ = ["answer_action", "gsm8k_code", "gsm8k_code_action", "gsm8k_traces"]
