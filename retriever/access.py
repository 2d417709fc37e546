"""Access control of the house's HTTP servers: ``copc retriever serve`` and ``copc env serve``.

It lives here, in the lowest layer that serves HTTP, so that both servers use the same code
(``environments.remote.auth`` re-exports it; see ``scripts/check_imports.py`` for the layers).
Standard library only.

The rule, the same for both servers:

* **Bind.** :func:`check_bind` refuses any address but a loopback one without a token (the
  servers run code or searches on behalf of their clients).
* **With a token** (:class:`BearerAuth`): every request but ``GET /health`` (a liveness probe
  that reveals nothing) must carry ``Authorization: Bearer <token>``, over HTTP and on the
  WebSocket handshake: a missing header is answered 401, a wrong token 403 (compared in
  constant time). ``Origin`` and ``Host`` are not checked then (a web page cannot read the
  token, nor add the header to a WebSocket handshake).
* **Without a token** (so on loopback; :class:`LoopbackGuard`): every request, ``/health``
  included, must come from a loopback client's point of view: a ``Host`` header, if present,
  must be a loopback name or address (any port), and an ``Origin`` header, if present (a web
  page sent it), must be the server's own origin (``http://`` + that ``Host``, same scheme, name
  and port) or one of the origins the server was configured to accept (``origins``; none by
  default). Otherwise 403 naming ``Origin`` / ``Host``. A loopback origin on another port is
  refused too: any local process can serve a page there (``copc view --serve``, a notebook, a
  dev server), and browsers apply no CORS to WebSockets nor to a ``text/plain`` POST. This
  refuses a page of another site or another local server that opens ``ws://127.0.0.1:8100/ws``
  (cross-site WebSocket hijacking) and DNS rebinding (a page whose own name resolves to
  127.0.0.1: its requests carry ``Host: evil.example``). Programs that send neither header
  (``curl``, ``httpx``, ``websockets``) are not affected.

Every refusal has the JSON body ``{"detail", "code", "field"}``; a refused WebSocket handshake
gets the same HTTP response (ASGI ``websocket.http.response`` extension) or, where the ASGI
server lacks it, a close with code 1008.
"""

from __future__ import annotations

import errno
import hmac
import ipaddress
import json
from pathlib import Path
from typing import Any, ClassVar
from urllib.parse import urlsplit

#: Paths served without a token (never without the loopback checks).
OPEN_PATHS = frozenset({"/health"})


class AccessError(Exception):
    """A request refused by access control.

    Args:
        code: ``"UNAUTHORIZED"`` (401) or ``"FORBIDDEN"`` (403).
        field: the header at fault (``"Authorization"``, ``"Origin"``, ``"Host"``).
        message: what is wrong, naming the header and value.
    """

    STATUS: ClassVar[dict[str, int]] = {"UNAUTHORIZED": 401, "FORBIDDEN": 403}

    def __init__(self, code: str, field: str, message: str) -> None:
        if code not in self.STATUS:
            raise ValueError(f"AccessError: unknown code {code!r}; known: {sorted(self.STATUS)}")
        super().__init__(message)
        self.code, self.field, self.message = code, field, message

    @property
    def status(self) -> int:
        """The HTTP status (401 or 403)."""
        return self.STATUS[self.code]

    def http_body(self) -> dict[str, Any]:
        """The JSON body of the HTTP refusal: ``detail``, ``code``, ``field``."""
        return {"detail": self.message, "code": self.code, "field": self.field}


def read_token_file(path: str | Path, field: str = "--token-file") -> str:
    """The token in ``path`` (surrounding whitespace removed).

    Args:
        path: a file holding the token. field: the option or config key, for messages.

    Raises:
        ValueError: the file is missing, unreadable or empty, or the token holds whitespace
            (the message names ``field``).
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
    """True for ``localhost`` and loopback IP addresses (``127.0.0.0/8``, ``::1``, ``[::1]``)."""
    if host.strip().lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip().strip("[]")).is_loopback
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
                         "(--token-file FILE): anyone who can reach that address could use the server")


def check_port(host: str, port: int, flag: str = "--port") -> None:
    """Refuse a ``port`` that cannot be bound on ``host`` (another process listens on it), before
    a server prints that it serves there. Port 0 (any free one) is not checked.

    The probe binds with ``SO_REUSEADDR``, as the servers do, so a port left in TIME_WAIT by an
    earlier server passes.

    Raises:
        ValueError: one line naming ``flag`` and the port, e.g. ``--port 8000: in use on
            127.0.0.1 (another process listens there; pick another port, or 0 for a free one)``.
    """
    import socket

    if not port:
        return
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError as e:
        raise ValueError(f"--host {host!r}: cannot resolve it ({e.strerror or e})") from None
    family, _, _, _, address = infos[0]
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(address)
        except OSError as e:
            why = ("in use" if e.errno == errno.EADDRINUSE else
                   "not allowed (ports below 1024 need privileges)" if e.errno == errno.EACCES else
                   f"cannot be bound ({e.strerror or e})")
            hint = " (another process listens there; pick another port, or 0 for a free one)" \
                if e.errno == errno.EADDRINUSE else ""
            raise ValueError(f"{flag} {port}: {why} on {host}{hint}") from None


def _header(headers: list[tuple[bytes, bytes]], name: bytes) -> str | None:
    """The first value of header ``name`` (lower case) in ASGI ``headers``, or None."""
    value = next((v for k, v in headers if k.lower() == name), None)
    return None if value is None else value.decode("latin-1").strip()


def check_header(headers: list[tuple[bytes, bytes]], token: str) -> None:
    """Check the ``Authorization: Bearer <token>`` header of an ASGI request.

    Raises:
        AccessError: ``UNAUTHORIZED`` (401) when the header is missing or not a bearer token,
            ``FORBIDDEN`` (403) when the token is wrong; field ``Authorization``.
    """
    value = _header(headers, b"authorization")
    if value is None:
        raise AccessError("UNAUTHORIZED", "Authorization",
                          "missing 'Authorization: Bearer <token>' header (this server requires a token)")
    scheme, _, given = value.partition(" ")
    if scheme.lower() != "bearer" or not given.strip():
        raise AccessError("UNAUTHORIZED", "Authorization",
                          f"Authorization header must be 'Bearer <token>', got scheme {scheme!r}")
    if not hmac.compare_digest(given.strip().encode(), token.encode()):
        raise AccessError("FORBIDDEN", "Authorization", "wrong bearer token")


def host_name(value: str) -> str:
    """The host of a ``Host`` header value: ``"127.0.0.1:8100"`` → ``"127.0.0.1"``,
    ``"[::1]:80"`` → ``"::1"``, ``"localhost"`` → ``"localhost"``."""
    value = value.strip()
    if value.startswith("["):
        return value[1:value.find("]")] if "]" in value else value
    return value.rsplit(":", 1)[0] if value.count(":") == 1 else value


def normalize_origin(origin: str, field: str = "origin") -> str:
    """``origin`` as browsers send it: ``scheme://host[:port]``, lower case, default port left out.

    Args:
        origin: e.g. ``"http://127.0.0.1:3000"``. field: the option or setting, for messages.

    Raises:
        ValueError: not an ``http(s)://host[:port]`` origin (a path, query, user or ``null``),
            naming ``field`` and the value.
    """
    try:
        parts = urlsplit(str(origin).strip())
        port = parts.port
    except ValueError:
        parts, port = None, None
    if parts is None or parts.scheme not in ("http", "https") or not parts.hostname \
            or parts.path not in ("", "/") or parts.query or parts.fragment or parts.username:
        raise ValueError(f"{field}={origin!r}: must be an origin, http(s)://host[:port] (no path)")
    host = parts.hostname.lower()
    host = f"[{host}]" if ":" in host else host
    default = {"http": 80, "https": 443}[parts.scheme]
    return f"{parts.scheme}://{host}" + (f":{port}" if port is not None and port != default else "")


def _same_origin(origin: str, host: str | None) -> bool:
    """Whether ``origin`` is ``http://`` + the ``Host`` header (the server's own pages)."""
    if host is None:
        return False
    try:
        return normalize_origin(origin) == normalize_origin(f"http://{host}")
    except ValueError:
        return False


def check_loopback_headers(headers: list[tuple[bytes, bytes]], origins: frozenset[str] = frozenset()) -> None:
    """Check that ``Host`` (if present) names a loopback host and that ``Origin`` (if present)
    is the server's own origin or one of ``origins``.

    Args:
        headers: the ASGI request's headers. origins: the accepted origins, normalized
            (:func:`normalize_origin`).

    Raises:
        AccessError: ``FORBIDDEN`` (403) naming ``Origin`` or ``Host`` and its value.
    """
    host = _header(headers, b"host")
    if host is not None and not is_loopback(host_name(host)):
        raise AccessError("FORBIDDEN", "Host",
                          f"Host {host[:100]!r} is not a loopback name: without a token this server "
                          "answers only requests addressed to 127.0.0.1 / localhost / [::1] "
                          "(DNS rebinding refused)")
    origin = _header(headers, b"origin")
    if origin is None or _same_origin(origin, host):
        return
    try:
        ok = normalize_origin(origin) in origins
    except ValueError:
        ok = False
    if not ok:
        raise AccessError("FORBIDDEN", "Origin",
                          f"Origin {origin[:100]!r} is not accepted: without a token this server answers "
                          "web pages only of its own origin or of a configured one (cross-site and "
                          "other local pages refused)")


async def refuse(scope: dict, send: Any, e: AccessError) -> None:
    """Answer an ASGI HTTP request or WebSocket handshake with ``e`` (status, JSON body)."""
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


class BearerAuth:
    """ASGI middleware: :func:`check_header` on every HTTP request and WebSocket handshake
    except :data:`OPEN_PATHS`.

    Args:
        app: the ASGI application. token: the required token.

    Raises:
        ValueError: empty ``token``.
    """

    def __init__(self, app: Any, token: str) -> None:
        if not token:
            raise ValueError("BearerAuth: token must be a non-empty str")
        self.app, self.token = app, token

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        """Pass the request on, or answer it with 401 / 403."""
        if scope["type"] in ("http", "websocket") and scope.get("path") not in OPEN_PATHS:
            try:
                check_header(scope.get("headers", []), self.token)
            except AccessError as e:
                await refuse(scope, send, e)
                return
        await self.app(scope, receive, send)


class LoopbackGuard:
    """ASGI middleware of a server without a token: :func:`check_loopback_headers` on every
    HTTP request and WebSocket handshake (``/health`` included).

    Args:
        app: the ASGI application. origins: the browser origins accepted besides the server's
            own (``http(s)://host[:port]``; none by default).

    Raises:
        ValueError: a malformed origin (:func:`normalize_origin`).
    """

    def __init__(self, app: Any, origins: tuple[str, ...] | list[str] = ()) -> None:
        self.app = app
        self.origins = frozenset(normalize_origin(o, "--allow-origin") for o in origins)

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        """Pass the request on, or answer it with 403."""
        if scope["type"] in ("http", "websocket"):
            try:
                check_loopback_headers(scope.get("headers", []), self.origins)
            except AccessError as e:
                await refuse(scope, send, e)
                return
        await self.app(scope, receive, send)


def protect(app: Any, host: str, token: str | None, origins: tuple[str, ...] | list[str] = ()) -> Any:
    """``app`` behind the access rule of the module docstring.

    Args:
        app: the ASGI application. host: the address it will bind. token: the bearer token
            (``None``: none). origins: browser origins accepted without a token besides the
            server's own (:class:`LoopbackGuard`).

    Returns:
        :class:`BearerAuth` around ``app`` with a token, :class:`LoopbackGuard` without.

    Raises:
        ValueError: a non-loopback ``host`` without a token (:func:`check_bind`), a malformed origin.
    """
    check_bind(host, token)
    return BearerAuth(app, token) if token else LoopbackGuard(app, origins)


__all__ = ["OPEN_PATHS", "AccessError", "BearerAuth", "LoopbackGuard", "check_bind", "check_header",
           "check_loopback_headers", "check_port", "host_name", "is_loopback", "normalize_origin", "protect",
           "read_token_file", "refuse"]
