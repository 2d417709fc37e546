"""Environments over the network with the OpenEnv protocol (``reset`` / ``step`` / ``state`` /
``health`` / ``schema`` over HTTP and ``/ws`` WebSocket sessions).

* Serve: ``copc env serve --env math_tool`` (:mod:`environments.remote.server`, needs the
  ``openenv`` extra) serves any registered environment, one session per episode.
* Consume: ``environments.make("remote", url="http://127.0.0.1:8100")`` is a
  :class:`~environments.remote.client.RemoteEnv`, a ``gymnasium.Env`` driving any OpenEnv server
  over its WebSocket session protocol (``task.env: remote`` in a training config). It needs
  ``websockets`` and ``httpx`` only.

See docs/remote_envs.md.
"""

from __future__ import annotations

from typing import Any

__all__ = ["RemoteEnv", "RemoteEnvConfig", "server_version"]


def server_version() -> str:
    """The installed ``copc`` package version (``"0+unknown"`` when not installed)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("copc")
    except PackageNotFoundError:
        return "0+unknown"


def __getattr__(name: str) -> Any:
    if name in ("RemoteEnv", "RemoteEnvConfig"):
        from . import client

        return getattr(client, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
