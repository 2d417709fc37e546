"""Sessions of the environment server: one environment per session, a bound on their number, an
idle timeout, and reuse of environments between sessions.

A session is one client's episode(s) on one environment instance: a ``/ws`` connection opens one
(and closes it when the connection ends, whatever the reason), or ``POST /reset`` without a
``session_id`` opens an HTTP session (closed by ``DELETE /sessions/{id}`` or the idle timeout).
Calls into a session's environment run one at a time, in a worker thread (environments block:
sandboxed code, retriever requests). A session with no request in flight for ``idle_timeout_s``
seconds (any request naming it counts: ``reset``, ``step``, ``state``) is closed (a WebSocket-
bound one is told why and disconnected). An environment whose session ended normally is reset-
cleared and kept for the next session, as the trainer's env pool does (``reuse_envs``); one
whose call raised is closed.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from environments.errors import InfrastructureError

from .adapter import GymTextEnvironment
from .wire import (
    CAPACITY_REACHED,
    FACTORY_ERROR,
    IDLE_TIMEOUT,
    INFRASTRUCTURE_ERROR,
    UNKNOWN_SESSION,
    RequestError,
)

log = logging.getLogger(__name__)


@dataclass(eq=False)
class Session:
    """One session: its id, environment, activity clock and (for ``/ws``) a disconnect hook.

    Attributes:
        id: the session id (32 hex digits). env: its environment.
        last_active: ``time.monotonic()`` of the end of the last request (seconds).
        busy: requests in flight. closed: set once the session is closed.
        healthy: False once a call raised (the environment is then closed, never reused).
        on_expire: awaited when the idle timeout closes the session (a ``/ws`` handler's hook
            that tells the client and disconnects).
    """

    id: str
    env: GymTextEnvironment
    last_active: float = field(default_factory=time.monotonic)
    busy: int = 0
    closed: bool = False
    healthy: bool = True
    on_expire: Callable[[], Awaitable[None]] | None = None
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)


class SessionManager:
    """The server's sessions (use from the server's event loop).

    Args:
        factory: builds a new :class:`GymTextEnvironment` (called in a worker thread).
        max_sessions: most sessions open at once (>= 1); more are refused (503).
        idle_timeout_s: seconds without a request after which a session is closed (> 0).
        reuse_envs: keep the environment of a normally ended session for the next one.
        executor: worker threads for environment calls.

    Raises:
        ValueError: ``max_sessions < 1`` or ``idle_timeout_s <= 0``.
    """

    def __init__(self, factory: Callable[[], GymTextEnvironment], max_sessions: int, idle_timeout_s: float,
                 reuse_envs: bool, executor: ThreadPoolExecutor) -> None:
        if not isinstance(max_sessions, int) or max_sessions < 1:
            raise ValueError(f"max_sessions={max_sessions!r}: must be an int >= 1")
        if not idle_timeout_s > 0:
            raise ValueError(f"idle_timeout_s={idle_timeout_s!r}: must be > 0 seconds")
        self.factory, self.max_sessions, self.idle_timeout_s = factory, max_sessions, float(idle_timeout_s)
        self.reuse_envs, self.executor = reuse_envs, executor
        self.sessions: dict[str, Session] = {}
        self._reserved = 0  # slots taken by sessions whose environment is being built
        self._idle_envs: list[GymTextEnvironment] = []
        self.opened_total = 0
        self.expired_total = 0

    @property
    def active(self) -> int:
        """Sessions open now (including ones whose environment is being built)."""
        return len(self.sessions) + self._reserved

    def add_idle_env(self, env: GymTextEnvironment) -> None:
        """Keep ``env`` (built elsewhere, e.g. the start-up probe) for the next session."""
        self._idle_envs.append(env)

    async def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)`` in a worker thread."""
        return await asyncio.get_running_loop().run_in_executor(self.executor, lambda: fn(*args))

    async def open(self) -> Session:
        """Open a session on an idle environment, or a new one.

        Raises:
            RequestError: ``CAPACITY_REACHED`` (503) with ``max_sessions`` open; ``FACTORY_ERROR``
                (500) / ``INFRASTRUCTURE_ERROR`` (503) when building the environment fails.
        """
        if self.active >= self.max_sessions:
            raise RequestError(CAPACITY_REACHED, "",
                               f"all {self.max_sessions} sessions are in use (--max-sessions); retry later")
        self._reserved += 1
        try:
            env = self._idle_envs.pop() if self._idle_envs else await self.call(self.factory)
        except InfrastructureError as e:
            raise RequestError(INFRASTRUCTURE_ERROR, "", f"building the environment failed: {e}") from e
        except Exception as e:
            log.exception("environment factory failed")
            raise RequestError(FACTORY_ERROR, "",
                               f"building the environment failed: {type(e).__name__}: {e}") from e
        finally:
            self._reserved -= 1
        session = Session(uuid.uuid4().hex, env)
        self.sessions[session.id] = session
        self.opened_total += 1
        return session

    def get(self, session_id: Any, field: str = "session_id") -> Session:
        """The open session ``session_id``.

        Raises:
            RequestError: ``UNKNOWN_SESSION`` (404) naming ``field``: no such session (never
                opened, closed, or expired after ``idle_timeout_s``).
        """
        session = self.sessions.get(session_id) if isinstance(session_id, str) else None
        if session is None:
            raise RequestError(UNKNOWN_SESSION, field,
                               f"{field}={session_id!r}: no such session (closed, expired after "
                               f"{self.idle_timeout_s:g} s idle, or never opened)")
        return session

    def touch(self, session: Session) -> None:
        """Count a request that does not call the environment (``GET /state``, a ``/ws``
        ``state`` message) as activity: the idle timeout starts again."""
        session.last_active = time.monotonic()

    async def run(self, session: Session, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)`` in a worker thread, one call at a time per session; marks the session
        unhealthy when ``fn`` raises anything but a :class:`RequestError`.

        Raises:
            RequestError: ``UNKNOWN_SESSION`` when the session was closed meanwhile; whatever
                ``fn`` raises.
        """
        session.busy += 1
        try:
            async with session.lock:
                if session.closed:
                    raise RequestError(UNKNOWN_SESSION, "session_id", f"session {session.id} was closed "
                                       f"(idle for {self.idle_timeout_s:g} s?)")
                try:
                    return await self.call(fn, *args)
                except RequestError:
                    raise
                except BaseException:
                    session.healthy = False
                    raise
        finally:
            session.busy -= 1
            session.last_active = time.monotonic()

    async def close(self, session: Session) -> None:
        """Close ``session`` (idempotent): wait for its call in flight, then keep its environment
        for reuse (healthy and ``reuse_envs``) or close it."""
        if session.closed:
            return
        session.closed = True
        self.sessions.pop(session.id, None)
        async with session.lock:
            env = session.env
        if session.healthy and self.reuse_envs and len(self._idle_envs) < self.max_sessions:
            env.detach()
            self._idle_envs.append(env)
            return
        try:
            await self.call(env.close)
        except Exception:
            log.warning("closing the environment of session %s failed", session.id, exc_info=True)

    async def expire_idle(self) -> int:
        """Close every session idle (no request in flight) for more than ``idle_timeout_s``.

        Returns:
            How many were closed.
        """
        now = time.monotonic()
        stale = [s for s in list(self.sessions.values())
                 if s.busy == 0 and now - s.last_active > self.idle_timeout_s]
        for s in stale:
            if s.on_expire is not None:
                with contextlib.suppress(Exception):
                    await s.on_expire()
            await self.close(s)
        self.expired_total += len(stale)
        return len(stale)

    async def reap_forever(self) -> None:
        """Run :meth:`expire_idle` every ``min(idle_timeout_s / 4, 1)`` seconds until cancelled."""
        interval = max(0.05, min(self.idle_timeout_s / 4, 1.0))
        while True:
            await asyncio.sleep(interval)
            try:
                await self.expire_idle()
            except Exception:
                log.warning("idle-session reaper failed (will retry)", exc_info=True)

    async def shutdown(self) -> None:
        """Close every session and every kept environment."""
        for s in list(self.sessions.values()):
            s.healthy = False
            await self.close(s)
        envs, self._idle_envs = self._idle_envs, []
        for env in envs:
            with contextlib.suppress(Exception):
                await self.call(env.close)


def expire_message(idle_timeout_s: float) -> RequestError:
    """The error a WebSocket client gets when its session expires."""
    return RequestError(IDLE_TIMEOUT, "session_id",
                        f"session closed after {idle_timeout_s:g} s without a request (--idle-timeout)")


__all__ = ["Session", "SessionManager", "expire_message"]
