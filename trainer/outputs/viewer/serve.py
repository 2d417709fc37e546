"""``copc view --serve``: the one viewer page over HTTP on 127.0.0.1, and nothing else.

The page is self-contained (its CSS, script and episodes are inline), so the server answers
``GET`` / ``HEAD`` of ``/`` and ``/<page name>`` with the page read at start, and 404 for any
other path: no other file of the run directory is served, and no directory is listed (a
``SimpleHTTPRequestHandler`` on the run directory served every file beside the page). A request
whose ``Host`` is not ``127.0.0.1`` / ``localhost`` / the bind host (optionally with the
server's port) is refused with 403: a page of another site whose name resolves to 127.0.0.1 (DNS
rebinding) cannot read the page. A connection silent for ``IDLE_TIMEOUT_S`` seconds is closed
(each holds a thread). Answers carry the page's Content-Security-Policy
(:func:`~.page.page_csp`), ``X-Content-Type-Options: nosniff`` and ``Cache-Control: no-store``.
"""

from __future__ import annotations

import http.server
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

from .page import page_csp

#: Seconds a connection may stay silent before the server closes it (:attr:`PageHandler.timeout`).
IDLE_TIMEOUT_S = 10.0


def allowed_hosts(host: str, port: int) -> frozenset[str]:
    """The ``Host`` header values served: ``127.0.0.1``, ``localhost`` and ``host``, each bare or
    with ``:port`` (lower case)."""
    names = {"127.0.0.1", "localhost", host.lower()}
    return frozenset(names | {f"{n}:{port}" for n in names})


class PageHandler(http.server.BaseHTTPRequestHandler):
    """Serves :attr:`page` at ``/`` and ``/<name>`` to requests with an allowed ``Host``.

    Class attributes (set by :func:`make_server` on a subclass): ``page`` (bytes), ``name``
    (the page's file name), ``hosts`` (:func:`allowed_hosts`).
    """

    page: bytes = b""
    name: str = "view.html"
    hosts: frozenset[str] = frozenset()
    #: Seconds a connection may wait for its request (socket timeout; the connection is then
    #: closed): without one every connection that sent nothing held a server thread forever.
    timeout = IDLE_TIMEOUT_S
    server_version = "copc-view"
    sys_version = ""

    def _answer(self, status: int, body: bytes, ctype: str) -> None:
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Content-Security-Policy", page_csp() + "; frame-ancestors 'none'")
        self.send_header("X-Content-Type-Options", "nosniff")
        self.send_header("Cache-Control", "no-store")
        self.send_header("Referrer-Policy", "no-referrer")
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def do_GET(self) -> None:
        """The page, or 403 (``Host``) / 404 (any other path)."""
        host = (self.headers.get("Host") or "").strip().lower()
        if host not in self.hosts:
            self._answer(403, f"Host {host[:100]!r} is not served: open http://127.0.0.1 (DNS rebinding "
                         "refused)\n".encode(), "text/plain; charset=utf-8")
            return
        path = unquote(urlsplit(self.path).path)
        if path in ("/", f"/{self.name}"):
            self._answer(200, self.page, "text/html; charset=utf-8")
        else:
            self._answer(404, b"not found: this server serves only the viewer page\n",
                         "text/plain; charset=utf-8")

    def do_HEAD(self) -> None:
        """As :meth:`do_GET`, without the body."""
        self.do_GET()

    def log_message(self, format: str, *args: Any) -> None:
        """Quiet: the page's URL is printed once at start."""


def make_server(page: str | Path, port: int, host: str = "127.0.0.1") -> http.server.ThreadingHTTPServer:
    """A server of ``page`` (read now) on ``host:port`` (0: a free port), not yet serving.

    Raises:
        OSError: the file cannot be read or the port bound.
    """
    page = Path(page)
    handler = type("ViewPageHandler", (PageHandler,), {"page": page.read_bytes(), "name": page.name})
    srv = http.server.ThreadingHTTPServer((host, port), handler)
    handler.hosts = allowed_hosts(host, srv.server_address[1])
    return srv


__all__ = ["IDLE_TIMEOUT_S", "PageHandler", "allowed_hosts", "make_server"]
