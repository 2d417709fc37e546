"""Settings of ``copc env serve`` (:class:`ServerConfig`), importable without the server's heavy
dependencies so that bad options are refused at once."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .auth import check_bind, normalize_origin

#: Default TCP port of ``copc env serve``.
DEFAULT_PORT = 8100


@dataclass(frozen=True)
class ServerConfig:
    """Settings of the environment server (validated).

    Attributes:
        env: registered environment id, or ``"pkg.module:id"`` / ``"file.py:id"`` (see
            :func:`environments.resolve`).
        env_kwargs: keyword overrides for ``environments.make`` (nested dicts allowed).
        host: address to bind; anything but a loopback address requires ``token``.
        port: TCP port (0: any free port).
        max_sessions: most sessions open at once (>= 1).
        idle_timeout_s: a session without a request for this long is closed (seconds, > 0).
        token: bearer token every request must carry (``None``: none, loopback only).
        allowed_origins: browser origins (``http(s)://host[:port]``) whose pages may call the
            server without a token, besides its own origin; none by default (a request with any
            other ``Origin`` is refused with 403).
        max_request_bytes: largest HTTP body / WebSocket message (bytes); ``0``: 12 bytes per
            character of the longest action plus 64 KiB (any action up to its length limit
            then reaches the server and is refused by name, with 413, if too long).
        reuse_envs: keep an environment for the next session after its session ends normally.
        sandbox_workers: workers of the shared sandbox pool (environments with a ``sandbox``
            argument).
        sandbox_isolation: that pool's ``SandboxConfig.isolation`` (``bwrap``, ``process`` or
            ``docker``; see docs/environments.md).
        threads: worker threads for environment calls (0: ``max_sessions + 4``, at most 1024).
        log_level: uvicorn log level.
    """

    env: str
    env_kwargs: dict[str, Any] = field(default_factory=dict)
    host: str = "127.0.0.1"
    port: int = DEFAULT_PORT
    max_sessions: int = 256
    idle_timeout_s: float = 600.0
    token: str | None = None
    allowed_origins: tuple[str, ...] = ()
    max_request_bytes: int = 0
    reuse_envs: bool = True
    sandbox_workers: int = 2
    sandbox_isolation: str = "bwrap"
    threads: int = 0
    log_level: str = "warning"

    def __post_init__(self) -> None:
        def bad(name: str, want: str) -> None:
            raise ValueError(f"ServerConfig.{name}={getattr(self, name)!r}: {want}")

        if not isinstance(self.env, str) or not self.env:
            bad("env", "must name a registered environment")
        if not isinstance(self.port, int) or not 0 <= self.port <= 65535:
            bad("port", "must be an int in [0, 65535]")
        for name in ("max_sessions", "sandbox_workers"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                bad(name, "must be an int >= 1")
        for name in ("max_request_bytes", "threads"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                bad(name, "must be an int >= 0")
        if not isinstance(self.idle_timeout_s, int | float) or not self.idle_timeout_s > 0:
            bad("idle_timeout_s", "must be a number of seconds > 0")
        if self.sandbox_isolation not in ("bwrap", "process", "docker"):
            bad("sandbox_isolation", "must be bwrap, process or docker")
        if self.token is not None and (not isinstance(self.token, str) or not self.token.strip()):
            bad("token", "must be a non-empty str or None")
        if isinstance(self.allowed_origins, str) or not isinstance(self.allowed_origins, tuple | list):
            bad("allowed_origins", "must be a list of origins, http(s)://host[:port]")
        for origin in self.allowed_origins:
            normalize_origin(origin, "--allow-origin")
        check_bind(self.host, self.token)


__all__ = ["DEFAULT_PORT", "ServerConfig"]
