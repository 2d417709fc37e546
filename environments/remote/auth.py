"""Bearer-token access control of the environment server.

The server runs code on behalf of its clients (a sandboxed interpreter, a retriever), so it
binds to a loopback address unless told otherwise, and :func:`check_bind` refuses any other
address without a token. With a token, every request but ``GET /health`` (a liveness probe that
reveals nothing) must carry ``Authorization: Bearer <token>``, over HTTP and on the WebSocket
handshake: a missing header is answered 401, a wrong token 403 (compared in constant time), each
with a JSON body ``{"detail", "code", "field": "Authorization"}``; a refused WebSocket handshake
gets the same HTTP response (ASGI ``websocket.http.response`` extension) or, where the server
lacks it, a plain 403.
"""

from __future__ import annotations

import hmac
import ipaddress
import json
from pathlib import Path
from typing import Any

from .wire import FORBIDDEN, UNAUTHORIZED, RequestError

#: Paths served without a token.
OPEN_PATHS = frozenset({"/health"})


def read_token_file(path: str | Path, field: str = "--token-file") -> str:
    """The token in ``path`` (surrounding whitespace removed).

    Args:
        path: a file holding the token. field: the option or config key, for messages.

    Raises:
        ValueError: the file is missing, unreadable or empty (the message names ``field``).
    """
    p = Path(path).expanduser()
    try:
        token = p.read_text(encoding="utf-8").strip()
    except OSError as e:
        raise ValueError(f"{field}={str(path)!r}: cannot read the token file ({e.strerror or e})") from None
    if not token:
        raise ValueError(f"{field}={str(path)!r}: the token file is empty")
    if any(c.isspace() for c in token):
        raise ValueError(f"{field}={str(path)!r}: the token must be one word (no whitespace inside)")
    return token


def is_loopback(host: str) -> bool:
    """True for ``localhost`` and loopback IP addresses (``127.0.0.0/8``, ``::1``)."""
    if host.strip().lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def check_bind(host: str, token: str | None) -> None:
    """Refuse to serve on a non-loopback ``host`` without a token.

    Raises:
        ValueError: ``host`` is not a loopback address and ``token`` is empty; the message says
            to pass ``--token-file``.
    """
    if not token and not is_loopback(host):
        raise ValueError(f"--host={host!r}: binding a non-loopback address requires a bearer token "
                         "(--token-file FILE); the server runs code on behalf of its clients")


def check_header(headers: list[tuple[bytes, bytes]], token: str) -> None:
    """Check the ``Authorization: Bearer <token>`` header of an ASGI request.

    Raises:
        RequestError: ``UNAUTHORIZED`` (401) when the header is missing or not a bearer token,
            ``FORBIDDEN`` (403) when the token is wrong; field ``Authorization``.
    """
    value = next((v for k, v in headers if k.lower() == b"authorization"), None)
    if value is None:
        raise RequestError(UNAUTHORIZED, "Authorization",
                           "missing 'Authorization: Bearer <token>' header (this server requires a token)")
    scheme, _, given = value.decode("latin-1").strip().partition(" ")
    if scheme.lower() != "bearer" or not given.strip():
        raise RequestError(UNAUTHORIZED, "Authorization",
                           f"Authorization header must be 'Bearer <token>', got scheme {scheme!r}")
    if not hmac.compare_digest(given.strip().encode(), token.encode()):
        raise RequestError(FORBIDDEN, "Authorization", "wrong bearer token")


class BearerAuth:
    """ASGI middleware: :func:`check_header` on every HTTP request and WebSocket handshake
    except :data:`OPEN_PATHS`.

    Args:
        app: the ASGI application. token: the required token.
    """

    def __init__(self, app: Any, token: str) -> None:
        if not token:
            raise ValueError("BearerAuth: token must be a non-empty str")
        self.app, self.token = app, token

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        """Pass the request on, or answer it with 401 / 403."""
        if scope["type"] not in ("http", "websocket") or scope.get("path") in OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        try:
            check_header(scope.get("headers", []), self.token)
        except RequestError as e:
            body = json.dumps(e.http_body()).encode()
            headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
            if e.status == 401:
                headers.append((b"www-authenticate", b"Bearer"))
            if scope["type"] == "http":
                await send({"type": "http.response.start", "status": e.status, "headers": headers})
                await send({"type": "http.response.body", "body": body})
            elif "websocket.http.response" in scope.get("extensions", {}):
                await send({"type": "websocket.http.response.start", "status": e.status, "headers": headers})
                await send({"type": "websocket.http.response.body", "body": body})
            else:
                await send({"type": "websocket.close", "code": 1008, "reason": e.message[:120]})
            return
        await self.app(scope, receive, send)


__all__ = ["OPEN_PATHS", "BearerAuth", "check_bind", "check_header", "is_loopback", "read_token_file"]
