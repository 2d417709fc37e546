"""The harness endpoint: ``POST /v1/chat/completions`` on 127.0.0.1, one API key per episode.

A Starlette app served by uvicorn on the event loop that plays the episodes (the engine's and the
agents'), bound to loopback on a free port. Each request is routed by its bearer key to its
:class:`~.episode.Episode`, whose :meth:`~.episode.Episode.complete` the handler awaits: no thread
hand-off per call (``benchmarks/bench_harness.py``).

Answers: ``200`` a ``chat.completion``; ``400`` a malformed request or a used-up budget; ``401``
an unknown key; ``410`` the key of a finished episode, also for a call that was still in flight
when its agent returned (the trajectory is frozen then: :meth:`Episode.close`); ``413`` a body over
``max_body_bytes`` (answered from ``Content-Length`` before the body is read, or as soon as a
chunked body passes it); ``408`` a body not received within ``header_timeout_s``; ``503`` the
engine failed (the episode is an infrastructure failure).
Non-streaming only (``stream: true`` is refused with ``400``). Connections: a header timeout and a
cap on connections waiting for their first request (:mod:`.connections`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import secrets
import socket
from typing import Any

from .connections import HEADER_TIMEOUT_S, MAX_WAITING_CONNECTIONS, guarded_protocol
from .episode import Episode, EpisodeClosedError, EpisodeInfraError
from .wire import RequestError, error_body

#: Finished keys remembered (answered 410, not 401); older ones are forgotten first.
_FINISHED_KEPT = 4096
#: Largest request body (bytes) by default: 16 MiB, far above any chat history that fits a context.
MAX_BODY_BYTES = 16 << 20


class _LoopServer:
    """Factory of a uvicorn server that leaves the process's signal handlers alone (the trainer's
    Ctrl-C stays the trainer's)."""

    @staticmethod
    def make(app: Any, header_timeout_s: float = HEADER_TIMEOUT_S,
             max_waiting: int = MAX_WAITING_CONNECTIONS) -> Any:
        """A ``uvicorn.Server`` for ``app`` on loopback, quiet, without signal capture, with the
        connection limits of :func:`~.connections.guarded_protocol`."""
        import uvicorn

        class Server(uvicorn.Server):
            @contextlib.contextmanager
            def capture_signals(self):
                """Install no signal handler (uvicorn's would take the trainer's SIGINT / SIGTERM)."""
                yield

        return Server(uvicorn.Config(app, log_level="warning", access_log=False, lifespan="off",
                                     http=guarded_protocol(header_timeout_s, max_waiting)))


class HarnessServer:
    """The endpoint of one process, served on the event loop that plays the episodes (the engine's
    and the agents' loop: no thread hand-off per call). Started by :meth:`start` from that loop
    (again on a new loop when the previous one is gone), stopped by :meth:`close`.

    Args:
        max_body_bytes: largest request body (bytes, >= 1; larger: ``413``).
        header_timeout_s: seconds a connection may take to send a request head, or stay idle.
        max_waiting_connections: most connections at once that have not sent a first request head.

    Attributes:
        base_url: ``http://127.0.0.1:<port>/v1`` once started (``""`` before).

    Raises:
        ValueError: a bad limit, naming it.
    """

    def __init__(self, max_body_bytes: int = MAX_BODY_BYTES, header_timeout_s: float = HEADER_TIMEOUT_S,
                 max_waiting_connections: int = MAX_WAITING_CONNECTIONS) -> None:
        if isinstance(max_body_bytes, bool) or not isinstance(max_body_bytes, int) or max_body_bytes < 1:
            raise ValueError(f"HarnessServer.max_body_bytes={max_body_bytes!r}: must be an int >= 1")
        guarded_protocol(header_timeout_s, max_waiting_connections)  # checks them
        self.max_body_bytes = max_body_bytes
        self._limits = (header_timeout_s, max_waiting_connections)
        self.base_url = ""
        self._episodes: dict[str, Episode] = {}
        self._finished: dict[str, None] = {}
        self._server: Any = None
        self._task: asyncio.Task | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._sock: socket.socket | None = None

    # -- lifecycle ---------------------------------------------------------------------------
    async def start(self) -> HarnessServer:
        """Serve on the running event loop (idempotent on the same loop; returns once the port
        accepts connections).

        Raises:
            RuntimeError: uvicorn did not start within 30 s.
        """
        from starlette.applications import Starlette
        from starlette.routing import Route

        loop = asyncio.get_running_loop()
        if not (self._loop is loop and self._task is not None and not self._task.done()):
            self.close()  # not started, or on a loop that is gone: serve on this one
            app = Starlette(routes=[Route("/v1/chat/completions", self._chat, methods=["POST"])])
            # IPPROTO_TCP explicitly: asyncio sets TCP_NODELAY only on sockets whose proto says TCP, and
            # without it a response written in two segments waits ~40 ms for the client's delayed ACK
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(("127.0.0.1", 0))
            server = _LoopServer.make(app, *self._limits)
            self._server, self._loop, self._sock = server, loop, sock
            self._task = loop.create_task(server.serve(sockets=[sock]), name="copc-harness-endpoint")
            self.base_url = f"http://127.0.0.1:{sock.getsockname()[1]}/v1"
        server, task = self._server, self._task  # episodes starting together all wait for it
        for _ in range(3000):
            if server.started:
                return self
            if task.done():
                raise RuntimeError(f"the harness endpoint did not start: {task.exception()!r}")
            await asyncio.sleep(0.01)
        raise RuntimeError("the harness endpoint did not start within 30 s")

    def close(self) -> None:
        """Stop serving (idempotent; from any thread: the server's loop finishes it, or it went with
        its loop) and release the port."""
        server, loop, sock = self._server, self._loop, self._sock
        self._server = self._task = self._loop = self._sock = None
        self.base_url = ""
        if server is not None:
            server.should_exit = True
        if sock is not None and (loop is None or loop.is_closed()):
            sock.close()

    # -- episodes ----------------------------------------------------------------------------
    def open(self, episode: Episode) -> str:
        """Serve ``episode`` under a new key; returns the key."""
        key = "copc-" + secrets.token_urlsafe(18)
        self._episodes[key] = episode
        return key

    def finish(self, key: str) -> None:
        """Stop serving ``key``'s episode and freeze it (:meth:`Episode.close`): later calls with it,
        and calls still in flight, get ``410``."""
        episode = self._episodes.pop(key, None)
        if episode is not None:
            episode.close()
        self._finished[key] = None
        while len(self._finished) > _FINISHED_KEPT:
            self._finished.pop(next(iter(self._finished)))

    # -- the route ---------------------------------------------------------------------------
    async def _chat(self, request: Any) -> Any:
        """``POST /v1/chat/completions`` (see the module docstring for the status codes)."""
        from starlette.responses import JSONResponse

        auth = request.headers.get("authorization", "")
        key = auth[7:].strip() if auth[:7].lower() == "bearer " else ""
        episode = self._episodes.get(key)
        if episode is None:
            if key in self._finished:
                return JSONResponse(error_body("this episode has finished; its key is no longer served",
                                               "episode_finished"), status_code=410)
            return JSONResponse(error_body("unknown API key: each episode has its own (the agent's "
                                           "api_key argument)", "invalid_api_key"), status_code=401)
        raw = await self._body(request)
        if not isinstance(raw, bytes):
            return raw
        try:
            body = json.loads(raw)
        except ValueError:
            return JSONResponse(error_body("the body is not JSON", "invalid_request_error"), status_code=400)
        if not isinstance(body, dict) or body.get("stream") or body.get("n", 1) != 1:
            return JSONResponse(error_body("the body must be a JSON object; stream and n > 1 are not "
                                           "supported", "invalid_request_error"), status_code=400)
        try:
            return JSONResponse(await episode.complete(body))
        except RequestError as e:
            return JSONResponse(error_body(str(e), "invalid_request_error"), status_code=400)
        except EpisodeInfraError as e:
            return JSONResponse(error_body(str(e), "engine_error"), status_code=503)
        except EpisodeClosedError as e:
            return JSONResponse(error_body(str(e), "episode_finished"), status_code=410)

    async def _body(self, request: Any) -> Any:
        """The request body as bytes, or the ``413`` / ``400`` / ``408`` response that refuses it: a
        ``Content-Length`` over :attr:`max_body_bytes` is refused before any of the body is read, a
        body without one as soon as it passes the limit; a body not all there within
        ``header_timeout_s`` seconds gets ``408`` (a key holder's trickled body held the connection
        and its handler with no limit, also after its episode had finished)."""
        from starlette.responses import JSONResponse

        limit = self.max_body_bytes
        too_big = JSONResponse(error_body(f"the request body exceeds the endpoint's max_body_bytes={limit}",
                                          "request_too_large"), status_code=413)
        length = request.headers.get("content-length")
        if length is not None:
            if not length.strip().isdigit():
                return JSONResponse(error_body(f"Content-Length {length[:40]!r} is not a number",
                                               "invalid_request_error"), status_code=400)
            if int(length) > limit:
                return too_big
        got = bytearray()
        try:
            async with asyncio.timeout(self._limits[0]):
                async for chunk in request.stream():
                    got += chunk
                    if len(got) > limit:
                        return too_big
        except TimeoutError:
            return JSONResponse(error_body(f"the request body did not arrive within the endpoint's "
                                           f"header_timeout_s={self._limits[0]:g}", "request_timeout"),
                                status_code=408, headers={"Connection": "close"})
        return bytes(got)
