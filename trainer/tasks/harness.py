"""The ``harness`` task: JSONL rows (as :class:`~trainer.tasks.generic.GenericTask`), episodes
played by a user agent against one OpenAI-compatible endpoint (:mod:`trainer.harness`).

The endpoint is the task's service: :meth:`HarnessTask.start_services` creates it (it starts
serving on the first episode, in the process that plays it) and :meth:`Task.close` stops it.
``task.env_kwargs``: ``agent`` (required), ``timeout_s``, ``tool_format``
(:class:`~trainer.harness.env.HarnessEnv`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..harness.env import HarnessEnv
from ..harness.server import HarnessServer
from .generic import GenericTask

if TYPE_CHECKING:
    import gymnasium


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

    def make_env(self) -> gymnasium.Env:
        """A :class:`HarnessEnv` with ``task.env_kwargs`` on the task's endpoint (its own one before
        :meth:`start_services`).

        Raises:
            ValueError: bad ``task.env_kwargs`` (naming the key).
        """
        return HarnessEnv(**self.env_kwargs, server=getattr(self, "_server", None))


__all__ = ["HarnessTask"]
