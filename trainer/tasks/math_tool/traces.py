"""ReTool warm-start traces of the ``math_tool`` task, produced by stepping the REAL ``MathToolEnv``.

Turn 1 is a ``<code>`` call computing the expression, the sandbox's real ``<interpreter>``
reply follows, and turn 2 copies the interpreter output into ``\\boxed{}`` (ReTool's cold-start
format, Feng et al. 2025, arXiv:2504.11536); or a single ``\\boxed{estimate}`` answered from the
head (:func:`direct_answer_traces`). Actions are kept short on purpose: tiny byte-level models
learn short copy tasks best. The traces are played by :func:`trainer.warmstart.play_traces`.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from ...warmstart.traces import Trace, TraceError, play_traces
from .arithmetic import expression_of

#: A short math prompt template for tiny models (``MathToolConfig.prompt_template``).
SHORT_MATH_PROMPT = "Compute with Python in <code>, answer in \\boxed{{}}.\n{problem}\n"
#: Default phrase before the code call.
REASONING = "Let me compute it.\n"

_INTERPRETER = re.compile(r"<interpreter>\n?(.*?)\n?</interpreter>", re.DOTALL)


def retool_code_action(problem: str, reasoning: str = REASONING) -> str:
    """Turn-1 action: a short phrase and one ReTool ``<code>`` call evaluating the problem's
    expression (its value is printed: the env prints a bare last expression)."""
    return f"{reasoning}<code>\n```python\n{expression_of(problem)}\n```\n</code>"


def boxed_action(value: str) -> str:
    """Final action: ``\\boxed{value}``."""
    return f"\\boxed{{{value}}}"


def _play(env: Any, sample: Mapping[str, Any], first: str,
          final_of: Callable[[str], str]) -> Trace:
    """Reset ``env`` on ``sample``, step ``first``, then ``final_of(observation)``; checks that
    the episode is a correct two-turn one."""
    sid = sample.get("id")
    prompt, _ = env.reset(options={"sample": dict(sample)})
    obs, _, term, trunc, info = env.step(first)
    if term or trunc or not info.get("tool"):
        raise TraceError(f"sample {sid!r}: the tool call was not executed (info={info})")
    final = final_of(obs)
    _, reward, term, _, info = env.step(final)
    if not term or reward <= 0.5:
        raise TraceError(f"sample {sid!r}: scripted answer {final!r} scored {reward} "
                         f"(components {info.get('reward_components')}); observation was {obs!r}")
    return Trace(prompt, [("action", first), ("observation", obs), ("action", final)])


def estimate(answer: str) -> str:
    """A head-math estimate of an integer answer: rounded to 2 significant digits.

    ``"1888264"`` → ``"1900000"``; used for warm-start traces that answer without the tool.
    """
    v = int(answer)
    if v == 0:
        return "0"
    digits = len(str(abs(v)))
    return str(round(v, -(digits - 2)) if digits > 2 else v)


def direct_answer_traces(samples: Sequence[Mapping[str, Any]], env_factory: Callable[[], Any], *,
                         progress: bool = False) -> list[Trace]:
    """Traces that answer from the head, without the tool: one action ``\boxed{estimate}``.

    Stepped through the real ``MathToolEnv`` like :func:`retool_traces` (the env scores the
    estimate, usually as wrong). Mixed into the warm-start data they leave the policy using
    the tool only part of the time, which RL with a correctness reward can then improve.

    Returns:
        One single-action :class:`Trace` per sample, in order.

    Raises:
        TraceError: if the env does not end the episode on the answer.
    """
    def play(env: Any, sample: Mapping[str, Any]) -> Trace:
        prompt, _ = env.reset(options={"sample": dict(sample)})
        action = boxed_action(estimate(str(sample["answer"])))
        _, _, term, _, _ = env.step(action)
        if not term:
            raise TraceError(f"sample {sample.get('id')!r}: a direct answer did not end the episode")
        return Trace(prompt, [("action", action)])

    return play_traces(samples, env_factory, play, progress=progress, desc="direct-answer traces")


def retool_traces(samples: Sequence[Mapping[str, Any]], env_factory: Callable[[], Any], *,
                  reasoning: str = REASONING, progress: bool = False) -> list[Trace]:
    """ReTool-format traces of arithmetic samples, by stepping a real ``MathToolEnv``.

    Turn 1 = ``reasoning`` + a ``<code>`` call computing the expression; the env runs it in its
    sandbox and replies ``<interpreter>…</interpreter>``; turn 2 copies the interpreter's output
    into ``\\boxed{}``. One env from ``env_factory`` serves all samples (reset each time) and is
    closed at the end (give it a shared sandbox to keep start-up cheap).

    Args:
        samples: rows ``{"id", "problem": "What is <expr>?", "answer"}``
            (:func:`~trainer.tasks.math_tool.arithmetic.retool_arithmetic_samples`).
        env_factory: ``() -> MathToolEnv`` (e.g. with ``prompt_template=SHORT_MATH_PROMPT``).
        reasoning: text before the code call.
        progress: show a tqdm bar.

    Returns:
        One :class:`Trace` per sample, in order: ``action, observation, action``.

    Raises:
        ValueError: a problem is not ``"What is <expr>?"``.
        TraceError: the sandbox did not run the code, or the copied output was not scored
            correct (no trace is silently dropped).
    """
    def final_of(obs: str) -> str:
        m = _INTERPRETER.search(obs)
        if m is None:
            raise TraceError(f"no <interpreter> block in the observation {obs!r}")
        return boxed_action(m.group(1).strip())

    return play_traces(samples, env_factory,
                       lambda env, s: _play(env, s, retool_code_action(s["problem"], reasoning), final_of),
                       progress=progress, desc="retool traces")


__all__ = ["REASONING", "SHORT_MATH_PROMPT", "boxed_action", "direct_answer_traces", "estimate",
           "retool_code_action", "retool_traces"]
