"""The harness endpoint: ``POST /v1/chat/completions`` on 127.0.0.1, one API key per episode.

A Starlette app served by uvicorn in a thread of its own (its own event loop), bound to loopback
on a free port. Each request is routed by its bearer key to its :class:`~.episode.Episode`, whose
:meth:`~.episode.Episode.complete` runs on the event loop of the engine that plays the episode
(``asyncio.run_coroutine_threadsafe``), so the engine is only ever called from its own loop.

Answers: ``200`` a ``chat.completion``; ``400`` a malformed request or a used-up budget; ``401``
an unknown key; ``410`` the key of a finished episode; ``503`` the engine failed (the episode is
an infrastructure failure). Non-streaming only (``stream: true`` is refused with ``400``).
"""

from __future__ import annotations

import asyncio
import secrets
import socket
import threading
from typing import Any

from .episode import Episode, EpisodeInfraError
from .wire import RequestError, error_body

#: Finished keys remembered (answered 410, not 401); older ones are forgotten first.
_FINISHED_KEPT = 4096


class HarnessServer:
    """The endpoint of one process (started on first use, stopped by :meth:`close`).

    Attributes:
        base_url: ``http://127.0.0.1:<port>/v1`` once started (``""`` before).
    """

    def __init__(self) -> None:
        self.base_url = ""
        self._episodes: dict[str, tuple[Episode, asyncio.AbstractEventLoop]] = {}
        self._finished: dict[str, None] = {}
        self._lock = threading.Lock()
        self._server: Any = None
        self._thread: threading.Thread | None = None

    # -- lifecycle ---------------------------------------------------------------------------
    def start(self) -> HarnessServer:
        """Start serving (idempotent; blocks until the port accepts connections).

        Raises:
            RuntimeError: uvicorn did not start within 30 s.
        """
        import uvicorn
        from starlette.applications import Starlette
        from starlette.routing import Route

        with self._lock:
            if self._thread is not None:
                return self
            app = Starlette(routes=[Route("/v1/chat/completions", self._chat, methods=["POST"])])
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(("127.0.0.1", 0))
            config = uvicorn.Config(app, log_level="warning", access_log=False, lifespan="off")
            self._server = uvicorn.Server(config)
            self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [sock]},
                                            name="copc-harness", daemon=True)
            self._thread.start()
            for _ in range(3000):
                if self._server.started:
                    break
                if not self._thread.is_alive():
                    raise RuntimeError("the harness endpoint did not start (see the log above)")
                threading.Event().wait(0.01)
            else:
                raise RuntimeError("the harness endpoint did not start within 30 s")
            self.base_url = f"http://127.0.0.1:{sock.getsockname()[1]}/v1"
        return self

    def close(self) -> None:
        """Stop serving and forget every episode (idempotent)."""
        with self._lock:
            server, thread, self._server, self._thread = self._server, self._thread, None, None
            self._episodes.clear()
            self.base_url = ""
        if server is not None:
            server.should_exit = True
        if thread is not None:
            thread.join(timeout=10)

    # -- episodes ----------------------------------------------------------------------------
    def open(self, episode: Episode, loop: asyncio.AbstractEventLoop) -> str:
        """Serve ``episode`` (its calls run on ``loop``) under a new key; returns the key."""
        key = "copc-" + secrets.token_urlsafe(18)
        with self._lock:
            self._episodes[key] = (episode, loop)
        return key

    def finish(self, key: str) -> None:
        """Stop serving ``key``'s episode: later calls with it get ``410``."""
        with self._lock:
            self._episodes.pop(key, None)
            self._finished[key] = None
            while len(self._finished) > _FINISHED_KEPT:
                self._finished.pop(next(iter(self._finished)))

    # -- the route ---------------------------------------------------------------------------
    async def _chat(self, request: Any) -> Any:
        """``POST /v1/chat/completions`` (see the module docstring for the status codes)."""
        from starlette.responses import JSONResponse

        auth = request.headers.get("authorization", "")
        key = auth[7:].strip() if auth[:7].lower() == "bearer " else ""
        with self._lock:
            entry = self._episodes.get(key)
            finished = key in self._finished
        if entry is None:
            if finished:
                return JSONResponse(error_body("this episode has finished; its key is no longer served",
                                               "episode_finished"), status_code=410)
            return JSONResponse(error_body("unknown API key: each episode has its own (the agent's "
                                           "api_key argument)", "invalid_api_key"), status_code=401)
        try:
            body = await request.json()
        except ValueError:
            return JSONResponse(error_body("the body is not JSON", "invalid_request_error"), status_code=400)
        if not isinstance(body, dict) or body.get("stream") or body.get("n", 1) != 1:
            return JSONResponse(error_body("the body must be a JSON object; stream and n > 1 are not "
                                           "supported", "invalid_request_error"), status_code=400)
        episode, loop = entry
        try:
            fut = asyncio.run_coroutine_threadsafe(episode.complete(body), loop)
            return JSONResponse(await asyncio.wrap_future(fut))
        except RequestError as e:
            return JSONResponse(error_body(str(e), "invalid_request_error"), status_code=400)
        except EpisodeInfraError as e:
            return JSONResponse(error_body(str(e), "engine_error"), status_code=503)
