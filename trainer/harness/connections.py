"""Connection limits of the harness endpoint that uvicorn does not have.

uvicorn (0.55) arms no timer on a new connection: one that sends nothing, or sends its request
headers a byte at a time, is held forever (its keep-alive timer runs only after a response, and
any byte received cancels it), and ``limit_concurrency`` is checked only once a request's headers
are complete, so connections that never finish them are not counted. :func:`guarded_protocol`
subclasses uvicorn's HTTP protocol with both:

* **a header timeout**: a connection with no request under way (none started yet, or the previous
  one answered) is closed ``header_timeout_s`` seconds after it was opened or last answered, and
  every ``header_timeout_s`` after that while that holds (a request being served is never cut);
* **a cap on connections waiting for their first request**: beyond ``max_waiting`` such
  connections a new one is closed at once (connections serving or between requests are not
  counted: agents mid-episode keep theirs).
"""

from __future__ import annotations

import asyncio
from typing import Any

#: Seconds a connection may take to send a request's headers (or stay idle between requests).
HEADER_TIMEOUT_S = 10.0
#: Most connections open at once that have not yet sent a whole request head.
MAX_WAITING_CONNECTIONS = 1024


def _base_protocol() -> type[asyncio.Protocol]:
    """uvicorn's HTTP protocol class (``http="auto"``: httptools if installed, else h11)."""
    from uvicorn.protocols.http.auto import AutoHTTPProtocol

    return AutoHTTPProtocol


def guarded_protocol(header_timeout_s: float = HEADER_TIMEOUT_S,
                     max_waiting: int = MAX_WAITING_CONNECTIONS) -> type[asyncio.Protocol]:
    """uvicorn's HTTP protocol with the limits of the module docstring (pass as ``Config(http=...)``).

    Args:
        header_timeout_s: seconds (> 0) a connection may stay without a request under way.
        max_waiting: most connections (>= 1) waiting for their first request head.

    Returns:
        A protocol class; its connections waiting for a first request are counted per class (one
        class per server).

    Raises:
        ValueError: a bad limit, naming it.
    """
    if isinstance(header_timeout_s, bool) or not isinstance(header_timeout_s, int | float) \
            or not header_timeout_s > 0:
        raise ValueError(f"header_timeout_s={header_timeout_s!r}: must be a number of seconds > 0")
    if isinstance(max_waiting, bool) or not isinstance(max_waiting, int) or max_waiting < 1:
        raise ValueError(f"max_waiting_connections={max_waiting!r}: must be an int >= 1")
    base: Any = _base_protocol()
    waiting: set[Any] = set()

    class GuardedHTTPProtocol(base):
        """uvicorn's protocol with a header timeout and a cap on waiting connections."""

        def connection_made(self, transport: Any) -> None:
            super().connection_made(transport)
            self._copc_timer = None
            if len(waiting) >= max_waiting:
                transport.abort()  # refused: too many connections are waiting for their headers
                return
            waiting.add(self)
            self._copc_arm()

        def _copc_arm(self) -> None:
            self._copc_seen = self.cycle
            self._copc_timer = self.loop.call_later(header_timeout_s, self._copc_check)

        def _copc_check(self) -> None:
            """Close the connection if no request started since the timer was armed and none is
            being served; else look again ``header_timeout_s`` later."""
            self._copc_timer = None
            if self.transport.is_closing():
                return
            cycle = self.cycle
            if cycle is self._copc_seen and (cycle is None or cycle.response_complete):
                self.transport.abort()
                return
            self._copc_arm()

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            if self.cycle is not None:
                waiting.discard(self)

        def connection_lost(self, exc: Exception | None) -> None:
            waiting.discard(self)
            if getattr(self, "_copc_timer", None) is not None:
                self._copc_timer.cancel()
                self._copc_timer = None
            super().connection_lost(exc)

    GuardedHTTPProtocol.waiting = waiting  # type: ignore[attr-defined]  # for tests and counters
    return GuardedHTTPProtocol


__all__ = ["HEADER_TIMEOUT_S", "MAX_WAITING_CONNECTIONS", "guarded_protocol"]
