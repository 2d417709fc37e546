"""Scripted warm-start traces, produced by stepping the REAL environments.

A trace is what the agent loop would see for one solved episode: the prompt text the
environment's ``reset`` returned, then the pieces of the response in order, each
``("action", model text)`` or ``("observation", environment text)``. Actions are
scripted; observations are whatever the real tool returned (the sandbox's
``<interpreter>`` reply, the retriever's ``<information>`` block).

* ReTool (math_tool): ``<code>`` call computing the expression → real ``<interpreter>`` →
  the interpreter output copied into ``\\boxed{}`` (ReTool's cold-start format, Feng et al.
  2025, arXiv:2504.11536).
* Search-R1 (search): :mod:`.search_traces` (answers copied from the real ``<information>``).

Actions are kept short on purpose: tiny byte-level models learn short copy tasks best.
"""

from __future__ import annotations

import random
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, NamedTuple

from environments.data import DEFAULT_DATA_DIR

from .arithmetic import expression_of

#: A short math prompt template for tiny models (``MathToolConfig.prompt_template``).
SHORT_MATH_PROMPT = "Compute with Python in <code>, answer in \\boxed{{}}.\n{problem}\n"
#: A short search prompt template for tiny models (``SearchConfig.prompt_template``).
SHORT_SEARCH_PROMPT = "Search with <search>, answer in <answer>.\nQuestion: {question}\n"
#: Default phrase before the code call.
REASONING = "Let me compute it.\n"

_INTERPRETER = re.compile(r"<interpreter>\n?(.*?)\n?</interpreter>", re.DOTALL)


class Trace(NamedTuple):
    """One scripted episode: ``(prompt, pieces)`` (unpacks like a 2-tuple).

    Attributes:
        prompt: the prompt text returned by the environment's ``reset``.
        pieces: ``[(kind, text), ...]`` in order, ``kind`` in ``{"action", "observation"}``;
            the first and the last piece are actions.
    """

    prompt: str
    pieces: list[tuple[str, str]]


class TraceError(RuntimeError):
    """The real environment did not answer a scripted step as a correct episode would."""


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

    return _each(samples, env_factory, progress, "direct-answer traces", play)


def _each(samples: Sequence[Mapping[str, Any]], env_factory: Callable[[], Any], progress: bool,
          desc: str, play: Callable[[Any, Mapping[str, Any]], Trace | None]) -> list[Trace]:
    """``play(env, sample)`` for every sample on one env (closed at the end), in order; a sample
    whose ``play`` returns None gives no trace."""
    from tqdm.auto import tqdm

    env = env_factory()
    try:
        traces = (play(env, s) for s in tqdm(samples, desc=desc, disable=not progress, leave=False))
        return [t for t in traces if t is not None]
    finally:
        close = getattr(env, "close", None)
        if close is not None:
            close()


def retool_traces(samples: Sequence[Mapping[str, Any]], env_factory: Callable[[], Any], *,
                  reasoning: str = REASONING, progress: bool = False) -> list[Trace]:
    """ReTool-format traces of arithmetic samples, by stepping a real ``MathToolEnv``.

    Turn 1 = ``reasoning`` + a ``<code>`` call computing the expression; the env runs it in its
    sandbox and replies ``<interpreter>…</interpreter>``; turn 2 copies the interpreter's output
    into ``\\boxed{}``. One env from ``env_factory`` serves all samples (reset each time) and is
    closed at the end (give it a shared sandbox to keep start-up cheap).

    Args:
        samples: rows ``{"id", "problem": "What is <expr>?", "answer"}``
            (:func:`~trainer.warmstart.arithmetic.retool_arithmetic_samples`).
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

    return _each(samples, env_factory, progress, "retool traces",
                 lambda env, s: _play(env, s, retool_code_action(s["problem"], reasoning), final_of))


def search_r1_samples(datasets: Iterable[str] = ("nq", "hotpotqa"), *, n: int | None = None,
                      seed: int = 0, offset: int = 0, data_dir: str = DEFAULT_DATA_DIR
                      ) -> list[dict[str, Any]]:
    """Questions of the shared QA sets (``<data_dir>/qa/<name>.jsonl``), shuffled with ``seed``.

    Rows of all ``datasets`` are pooled, ids are prefixed with the dataset name
    (``"nq/test_3283"``: ids of different sets may collide), the pool is shuffled with
    ``random.Random(seed)``, and rows ``[offset, offset + n)`` are returned (all from
    ``offset`` if ``n`` is None). Disjoint ranges give disjoint train / held-out splits.

    Returns:
        Dicts ``{"id", "question", "golden_answers": [str, ...], "data_source"}``.

    Raises:
        FileNotFoundError / ValueError: a missing or malformed data file (from
            :func:`environments.search.env.load_qa`); ValueError on negative ``n`` / ``offset``
            or a range past the end of the pool.
    """
    from environments.search.env import load_qa

    if offset < 0 or (n is not None and n < 0):
        raise ValueError(f"search_r1_samples: n={n!r} and offset={offset!r} must be >= 0")
    pool = []
    for name in datasets:
        for row in load_qa(name, data_dir):
            pool.append({**row, "id": f"{name}/{row['id']}", "data_source": name})
    random.Random(seed).shuffle(pool)
    end = len(pool) if n is None else offset + n
    if end > len(pool):
        raise ValueError(f"search_r1_samples: offset={offset} + n={n} exceeds the {len(pool)} "
                         f"questions of {tuple(datasets)}")
    return pool[offset:end]
