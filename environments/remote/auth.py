"""Access control of the environment server: the house's one rule, :mod:`retriever.access`.

The server runs code on behalf of its clients (a sandboxed interpreter, a retriever), so it
binds to a loopback address unless told otherwise, and :func:`check_bind` refuses any other
address without a token. With a token, every request but ``GET /health`` must carry
``Authorization: Bearer <token>`` (HTTP and the WebSocket handshake; 401 missing, 403 wrong).
Without one, every request must carry a loopback ``Host`` (or none) and an ``Origin`` (or none)
that is the server's own or one configured (``--allow-origin``; none by default: a page served by
another local process is refused too), else 403 naming the header: cross-site WebSocket hijacking
and DNS rebinding are refused. Details: :mod:`retriever.access` (shared with ``copc retriever serve``).
"""

from __future__ import annotations

from retriever.access import (
    OPEN_PATHS,
    AccessError,
    BearerAuth,
    LoopbackGuard,
    check_bind,
    is_loopback,
    normalize_origin,
    protect,
    read_token_file,
)
from retriever.access import check_header as _check_header

from .wire import RequestError


def check_header(headers: list[tuple[bytes, bytes]], token: str) -> None:
    """:func:`retriever.access.check_header`, raising the server's :class:`RequestError`.

    Raises:
        RequestError: ``UNAUTHORIZED`` (401) / ``FORBIDDEN`` (403), field ``Authorization``.
    """
    try:
        _check_header(headers, token)
    except AccessError as e:
        raise RequestError(e.code, e.field, e.message) from None


__all__ = ["OPEN_PATHS", "BearerAuth", "LoopbackGuard", "check_bind", "check_header", "is_loopback",
           "normalize_origin", "protect", "read_token_file"]
