"""The ``harness`` task: JSONL rows (as :class:`~trainer.tasks.generic.GenericTask`), episodes
played by a user agent against one OpenAI-compatible endpoint (:mod:`trainer.harness`; its
:meth:`~trainer.tasks.base.Task.episode` is :func:`~trainer.harness.env.harness_episode`).

The endpoint is the task's service: :meth:`HarnessTask.start_services` creates it (it starts
serving on the first episode, in the process that plays it) and :meth:`Task.close` stops it.
``task.env_kwargs``: ``agent`` (required), ``timeout_s``, ``tool_format``
(:class:`~trainer.harness.env.HarnessEnv`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..harness.env import HarnessEnv, harness_episode
from ..harness.server import HarnessServer
from .generic import GenericTask

if TYPE_CHECKING:
    from ..rollout.groups import EpisodeFn


class HarnessTask(GenericTask):
    """``task.env: harness`` (see the module docstring)."""

    service_names = "the harness endpoint"

    def start_services(self) -> None:
        """Create the endpoint the environments share (stopped by :meth:`close`)."""
        self._server = HarnessServer()
        self.add_closer(self._server.close)

    def start(self) -> None:
        """Read the rows (:meth:`GenericTask.start`), then create the endpoint."""
        super().start()
        self.start_services()

    def make_env(self) -> HarnessEnv:
        """A :class:`HarnessEnv` with ``task.env_kwargs`` on the task's endpoint (its own one before
        :meth:`start_services`).

        Raises:
            ValueError: bad ``task.env_kwargs`` (naming the key).
        """
        return HarnessEnv(**self.env_kwargs, server=getattr(self, "_server", None))

    def episode(self) -> EpisodeFn:
        """:func:`~trainer.harness.env.harness_episode`: the user's agent plays each episode
        against the endpoint (a :class:`HarnessEnv` has no ``step``)."""
        return harness_episode


__all__ = ["HarnessTask"]
