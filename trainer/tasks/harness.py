"""The ``harness`` task: JSONL rows (as :class:`~trainer.tasks.generic.GenericTask`), episodes
played by a user agent against one OpenAI-compatible endpoint (:mod:`trainer.harness`; its
:meth:`~trainer.tasks.base.Task.episode` is :func:`~trainer.harness.env.harness_episode`).

The endpoint is the task's service: :meth:`HarnessTask.start_services` creates it (it starts
serving on the first episode, in the process that plays it) and :meth:`Task.close` stops it.
``task.env_kwargs``: ``agent`` (required), ``timeout_s``, ``tool_format``
(:class:`~trainer.harness.env.HarnessEnv`); ``task.settings``: the endpoint's limits
(:class:`HarnessSettings`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..harness.connections import HEADER_TIMEOUT_S, MAX_WAITING_CONNECTIONS
from ..harness.env import HarnessEnv, harness_episode
from ..harness.server import MAX_BODY_BYTES, HarnessServer
from .generic import GenericTask
from .settings import require

if TYPE_CHECKING:
    from ..rollout.groups import EpisodeFn


@dataclass
class HarnessSettings:
    """The harness endpoint's limits (``task.settings`` of ``task.env: harness``; docs/harness.md).

    Attributes:
        max_body_bytes: the largest request body in bytes (16 MiB); a larger one is answered 413
            before it is read (from its ``Content-Length``; a chunked one once it passes the limit).
        header_timeout_s: seconds a connection may take to send a complete request (and stay idle
            between requests) before it is closed (10).
        max_waiting_connections: connections still waiting for their first complete request held
            at once (1024); one more is closed at once. Agents in mid-episode are not counted.
    """

    max_body_bytes: int = MAX_BODY_BYTES
    header_timeout_s: float = HEADER_TIMEOUT_S
    max_waiting_connections: int = MAX_WAITING_CONNECTIONS

    def __post_init__(self) -> None:
        """Raise :class:`~trainer.errors.ConfigError` naming ``task.settings.<key>`` on a bad value."""
        for key in ("max_body_bytes", "max_waiting_connections"):
            v = getattr(self, key)
            require(isinstance(v, int) and not isinstance(v, bool) and v >= 1, key, v, "must be an int >= 1")
        v = self.header_timeout_s
        require(isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0, "header_timeout_s", v,
                "must be > 0 (seconds)")


class HarnessTask(GenericTask):
    """``task.env: harness`` (see the module docstring)."""

    service_names = "the harness endpoint"
    settings_class = HarnessSettings

    def start_services(self) -> None:
        """Create the endpoint the environments share (stopped by :meth:`close`), with the limits
        of ``task.settings`` (:class:`HarnessSettings`)."""
        s: HarnessSettings = self.settings
        self._server = HarnessServer(max_body_bytes=s.max_body_bytes, header_timeout_s=s.header_timeout_s,
                                     max_waiting_connections=s.max_waiting_connections)
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


__all__ = ["HarnessSettings", "HarnessTask"]
