"""Where an episode's wall time goes: the model, the environment, or neither.

:class:`EpisodeClock` is started when an episode starts; every ``engine.generate`` call
(retries and their back-off included) is timed as ``llm`` and every ``env.reset`` / ``env.step``
call (the sandbox, the retriever, a remote env, an MCP tool: whatever the environment does
inside them, thread hand-off included) as ``env``. At the end :meth:`EpisodeClock.stamp` writes
three numbers, in seconds on the monotonic clock (``time.perf_counter``), into the trajectory's
``info``:

* ``llm_s`` — time inside generation;
* ``env_s`` — time inside the environment;
* ``other_s`` — the rest of the episode's wall time (tokenisation, chat templates, the event
  loop running other episodes between awaits): ``wall − llm_s − env_s``, never negative.

``llm_s + env_s + other_s`` is the episode's wall time. Any producer of trajectories (the agent
loop, a harness endpoint) times its calls with the same clock, so the split means the same for
all. The training loop sums them over a step's episodes (:data:`TIME_KEYS`,
:func:`trainer.orchestration.step_metrics.rollout_metrics`).
"""

from __future__ import annotations

import time
from collections.abc import Iterator, MutableMapping
from contextlib import AbstractContextManager, contextmanager
from typing import Any

#: ``info`` keys written by :meth:`EpisodeClock.stamp` (seconds), in the order llm, env, other.
TIME_KEYS = ("llm_s", "env_s", "other_s")


class EpisodeClock:
    """Accumulates one episode's time in generation and in the environment (seconds).

    Attributes:
        llm_s: seconds spent in ``engine.generate`` so far.
        env_s: seconds spent in ``env.reset`` / ``env.step`` so far.
    """

    def __init__(self) -> None:
        self._t0 = time.perf_counter()
        self.llm_s = 0.0
        self.env_s = 0.0

    @contextmanager
    def _timed(self, attr: str) -> Iterator[None]:
        """Add the block's wall time to ``self.<attr>``, also when it raises."""
        t = time.perf_counter()
        try:
            yield
        finally:
            setattr(self, attr, getattr(self, attr) + time.perf_counter() - t)

    def llm(self) -> AbstractContextManager[None]:
        """Time the block as generation (added to :attr:`llm_s` also when it raises)."""
        return self._timed("llm_s")

    def env(self) -> AbstractContextManager[None]:
        """Time the block as environment (added to :attr:`env_s` also when it raises)."""
        return self._timed("env_s")

    def split(self) -> dict[str, float]:
        """``{"llm_s", "env_s", "other_s"}`` now: ``other_s = max(0, wall − llm_s − env_s)``."""
        wall = time.perf_counter() - self._t0
        return {"llm_s": self.llm_s, "env_s": self.env_s, "other_s": max(0.0, wall - self.llm_s - self.env_s)}

    def stamp(self, info: MutableMapping[str, Any]) -> None:
        """Write :meth:`split` into ``info`` (a trajectory's ``info``)."""
        info.update(self.split())


__all__ = ["TIME_KEYS", "EpisodeClock"]
