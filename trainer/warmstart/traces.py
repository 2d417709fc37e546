"""Scripted warm-start traces: the trace type and the loop that plays them on a REAL environment.

A trace is what the agent loop would see for one solved episode: the prompt text the
environment's ``reset`` returned, then the pieces of the response in order, each
``("action", model text)`` or ``("observation", environment text)``. Actions are scripted by a
task (``trainer/tasks/<task>/traces.py``); observations are whatever the real tool returned.

Nothing here knows a task: a task writes a ``play(env, sample) -> Trace | None`` function and
hands it to :func:`play_traces`, which steps it through one environment of the task's factory.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple


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


def play_traces(samples: Sequence[Mapping[str, Any]], env_factory: Callable[[], Any],
                play: Callable[[Any, Mapping[str, Any]], Trace | None], *, progress: bool = False,
                desc: str = "traces") -> list[Trace]:
    """``play(env, sample)`` for every sample on one environment, in order.

    One environment from ``env_factory`` serves all samples (``play`` resets it for each) and is
    closed at the end, also when ``play`` raises.

    Args:
        samples: data rows, passed to ``play`` as they are.
        env_factory: ``() -> env`` (the task's :meth:`~trainer.tasks.Task.make_env`).
        play: plays one sample and returns its :class:`Trace`, or None when the sample gives
            none (it is then left out).
        progress: show a tqdm bar. desc: its label.

    Returns:
        The traces, in the order of ``samples`` (samples whose ``play`` returned None left out).

    Raises:
        Whatever ``play`` raises (e.g. :class:`TraceError`).
    """
    from ..outputs.progress import phase_bar

    env = env_factory()
    try:
        traces = (play(env, s) for s in phase_bar(samples, desc=desc, show=progress, leave=False))
        return [t for t in traces if t is not None]
    finally:
        close = getattr(env, "close", None)
        if close is not None:
            close()


__all__ = ["Trace", "TraceError", "play_traces"]
