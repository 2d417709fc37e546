"""HTTP and WebSocket routes of the environment server (see :mod:`environments.remote.server`).

OpenEnv endpoints: ``GET /health``, ``GET /metadata``, ``GET /schema``, ``POST /reset``,
``POST /step``, ``GET /state`` and the ``/ws`` session (``reset`` / ``step`` / ``state`` /
``close`` messages). HTTP sessions (an extension; OpenEnv's HTTP ``/reset`` / ``/step`` are
stateless): ``POST /reset`` without ``session_id`` opens one and returns its id in
``metadata.session_id``; ``POST /step`` and ``GET /state`` need it; ``DELETE /sessions/{id}``
closes it; ``GET /sessions`` reports how many are open. Every refused request gets a 4xx/5xx
naming the field (:class:`~environments.remote.wire.RequestError`) and the server keeps serving.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
from collections.abc import Callable
from typing import Any, Protocol

from fastapi import FastAPI, Request, WebSocket
from fastapi.responses import JSONResponse
from openenv.core.env_server.serialization import serialize_observation
from openenv.core.env_server.types import (
    HealthResponse,
    HealthStatus,
    ResetRequest,
    StepRequest,
    WSResetMessage,
    WSStepMessage,
)
from pydantic import ValidationError
from starlette.websockets import WebSocketDisconnect, WebSocketState

from environments.errors import InfrastructureError

from .protocol import TextAction
from .sessions import Session, SessionManager, expire_message
from .wire import (
    CLOSE_CODE_BASE,
    EXECUTION_ERROR,
    INFRASTRUCTURE_ERROR,
    INVALID_JSON,
    PAYLOAD_TOO_LARGE,
    UNKNOWN_TYPE,
    VALIDATION_ERROR,
    RequestError,
)

log = logging.getLogger(__name__)


class ServedEnv(Protocol):
    """What the routes need of the server that serves them (:class:`~environments.remote.server.EnvServer`
    has it; the server imports this module, never the reverse).

    Attributes:
        env_id: the served environment's id. sessions: its :class:`~.sessions.SessionManager`.
        max_request_bytes: largest HTTP body / WebSocket message (bytes). metadata: OpenEnv's
            ``EnvironmentMetadata``. schema: the ``GET /schema`` body. lifespan: the app's lifespan
            (an async context manager factory taking the app).
    """

    env_id: str
    sessions: SessionManager
    max_request_bytes: int
    metadata: Any
    schema: dict[str, Any]
    lifespan: Callable[[Any], Any]


#: Message of a JSON body / message nested deeper than Python's parser can follow (a client's
#: fault: 400 ``INVALID_JSON``, never a 500 blamed on the environment).
NESTED_TOO_DEEP = "is nested too deeply for the server's JSON parser (not accepted as JSON)"


def unparsable(e: ValueError) -> str:
    """The end of the message for JSON that parses but holds a value Python refuses to build
    (an integer of more than ``sys.get_int_max_str_digits()`` digits, 4,300 by default): a
    client's fault, 400 ``INVALID_JSON``, never a 500."""
    return f"holds a value the server cannot parse ({str(e).split(';')[0]}); not accepted as JSON"


def validation_error(e: ValidationError, prefix: str) -> RequestError:
    """A pydantic ``ValidationError`` as a 422 :class:`RequestError` whose field is the first
    error's location under ``prefix`` (``"data.text: Field required"``)."""
    parts = []
    for err in e.errors():
        loc = ".".join(str(x) for x in (prefix, *err.get("loc", ())) if x != "")
        parts.append(f"{loc}: {err.get('msg')}")
    first = e.errors()[0].get("loc", ()) if e.errors() else ()
    field = ".".join(str(x) for x in (prefix, *first) if x != "")
    return RequestError(VALIDATION_ERROR, field, "; ".join(parts))


def as_request_error(e: BaseException, op: str) -> RequestError:
    """Any exception of an environment call ``op`` (``"reset"`` / ``"step"``) as a
    :class:`RequestError`: itself, ``INFRASTRUCTURE_ERROR`` (503) for an
    :class:`InfrastructureError`, ``EXECUTION_ERROR`` (500) for anything else (logged: a bug of
    the environment, e.g. a step returning a non-``str`` observation)."""
    if isinstance(e, RequestError):
        return e
    if isinstance(e, InfrastructureError):
        return RequestError(INFRASTRUCTURE_ERROR, "", f"{op}: infrastructure failure: {e}")
    log.error("%s raised", op, exc_info=e)
    return RequestError(EXECUTION_ERROR, "", f"{op}: the environment raised {type(e).__name__}: {e}")


def refield(e: RequestError, old: str, new: str) -> RequestError:
    """``e`` with a field starting with ``old`` renamed to start with ``new`` (the HTTP names of
    WebSocket fields: ``data.text`` → ``action.text``, ``data.sample`` → ``sample``)."""
    if not e.field.startswith(old):
        return e
    return RequestError(e.code, new + e.field[len(old):], e.message)


def error_response(e: RequestError) -> JSONResponse:
    """The HTTP response of ``e``: its status and ``{"detail", "code", "field"}``."""
    return JSONResponse(e.http_body(), status_code=e.status)


def observation_payload(obs: Any, session: Session | None = None) -> dict[str, Any]:
    """OpenEnv's serialized observation; after a reset ``metadata.session_id`` names the session."""
    if session is not None:
        obs.metadata = {**obs.metadata, "session_id": session.id}
    return serialize_observation(obs)


#: Arguments of a reset (OpenEnv's ``seed`` / ``episode_id``; COPC's ``sample`` / ``options``).
RESET_ARGS = ("seed", "episode_id", "sample", "options")


def check_reset_args(args: dict[str, Any], prefix: str) -> None:
    """Check reset arguments against OpenEnv's ``ResetRequest`` and :data:`RESET_ARGS`.

    Raises:
        RequestError: ``VALIDATION_ERROR`` (422) naming ``prefix + field``: an unknown argument,
            a negative or non-integer ``seed``, an ``episode_id`` over 255 characters, a
            ``sample`` / ``options`` that is not a JSON object or holds a lone surrogate.
    """
    unknown = sorted(k for k in args if k not in RESET_ARGS)
    if unknown:
        raise RequestError(VALIDATION_ERROR, prefix + unknown[0],
                           f"reset: unknown argument {unknown[0]!r}; accepted: {', '.join(RESET_ARGS)}")
    try:
        ResetRequest.model_validate(args)
    except ValidationError as e:
        raise validation_error(e, prefix.rstrip(".")) from None
    for name in ("sample", "options"):
        if args.get(name) is not None and not isinstance(args[name], dict):
            raise RequestError(VALIDATION_ERROR, prefix + name,
                               f"reset: {name} must be a JSON object, got {type(args[name]).__name__}")
        bad = lone_surrogate(args.get(name), prefix + name)
        if bad is not None:
            raise RequestError(VALIDATION_ERROR, bad, f"reset: {bad} holds a lone UTF-16 surrogate (a JSON "
                               "\\uD800-style escape); send valid Unicode")


def lone_surrogate(value: Any, path: str) -> str | None:
    """The dotted path of a string (or of the mapping whose key is one) under ``value`` that holds
    a lone UTF-16 surrogate (JSON's ``\\ud800`` escapes can carry one; it is not text a tool or a
    JSON reply can take), or None; with several, which one is named is unspecified. Iterative:
    any nesting depth."""
    todo = [(value, path)]
    while todo:
        v, at = todo.pop()
        if isinstance(v, str):
            try:
                v.encode("utf-8")
            except UnicodeEncodeError:
                return at
        elif isinstance(v, dict):
            for k, item in v.items():
                if lone_surrogate(k, at) is not None:
                    return at
                todo.append((item, f"{at}.{k}"))
        elif isinstance(v, list):
            todo.extend((item, f"{at}[{i}]") for i, item in enumerate(v))
    return None


async def read_json(request: Request, limit: int) -> dict[str, Any]:
    """The JSON object of ``request``'s body, read up to ``limit`` bytes.

    Raises:
        RequestError: ``PAYLOAD_TOO_LARGE`` (413) over ``limit``; ``INVALID_JSON`` (400) for a
            body that is not JSON, nested too deeply to parse, or holding a value Python will not
            build (:func:`unparsable`); ``VALIDATION_ERROR`` (422) for one that is not an object.
    """
    size, chunks = 0, []
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise RequestError(PAYLOAD_TOO_LARGE, "body",
                               f"request body larger than {limit} bytes (--max-request-bytes)")
        chunks.append(chunk)
    raw = b"".join(chunks)
    try:
        body = json.loads(raw) if raw.strip() else {}
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise RequestError(INVALID_JSON, "body", f"request body is not valid JSON: {e}") from None
    except RecursionError:
        raise RequestError(INVALID_JSON, "body", f"request body {NESTED_TOO_DEEP}") from None
    except ValueError as e:  # valid JSON, a value Python will not build (a 5,000-digit integer)
        raise RequestError(INVALID_JSON, "body", f"request body {unparsable(e)}") from None
    if not isinstance(body, dict):
        raise RequestError(VALIDATION_ERROR, "body", f"request body must be a JSON object, got "
                                                     f"{type(body).__name__}")
    return body


def build_app(server: ServedEnv) -> FastAPI:
    """The FastAPI app of ``server`` (routes above; lifespan: ``server.lifespan``)."""
    app = FastAPI(title=f"COPC environment {server.env_id!r} (OpenEnv protocol)", lifespan=server.lifespan)
    sessions, limit = server.sessions, server.max_request_bytes

    @app.get("/health")
    async def health() -> dict[str, Any]:
        return HealthResponse(status=HealthStatus.HEALTHY).model_dump(mode="json")

    @app.get("/metadata")
    async def metadata() -> dict[str, Any]:
        return server.metadata.model_dump()

    @app.get("/schema")
    async def schema() -> dict[str, Any]:
        return server.schema

    @app.get("/sessions")
    async def session_counts() -> dict[str, Any]:
        return {"active_sessions": sessions.active, "max_sessions": sessions.max_sessions,
                "idle_timeout_s": sessions.idle_timeout_s, "opened_total": sessions.opened_total,
                "expired_total": sessions.expired_total}

    @app.post("/reset")
    async def http_reset(request: Request) -> Any:
        opened = None
        try:
            body = await read_json(request, limit)
            sid = body.pop("session_id", None)
            check_reset_args(body, "")
            session = sessions.get(sid) if sid is not None else None
            if session is None:
                session = opened = await sessions.open()
            obs = await sessions.run(session, functools.partial(session.env.reset, **body))
            return JSONResponse(observation_payload(obs, session))  # rendered here: a failure closes it
        except BaseException as e:
            if opened is not None:
                await sessions.close(opened)
            if isinstance(e, Exception):
                return error_response(refield(as_request_error(e, "reset"), "data.", ""))
            raise

    @app.post("/step")
    async def http_step(request: Request) -> Any:
        try:
            body = await read_json(request, limit)
            sid = body.pop("session_id", None)
            if sid is None:
                raise RequestError(VALIDATION_ERROR, "session_id",
                                   "session_id is required: HTTP /step acts on the session that POST /reset "
                                   "opened (its metadata.session_id); or use the /ws WebSocket session")
            session = sessions.get(sid)
            try:
                req = StepRequest.model_validate(body)
                action = TextAction.model_validate(req.action)
            except ValidationError as e:
                raise validation_error(e, "action" if "action" in body else "") from None
            obs = await sessions.run(session, session.env.step, action)
            return observation_payload(obs)
        except Exception as e:
            return error_response(refield(as_request_error(e, "step"), "data.", "action."))

    @app.get("/state")
    async def http_state(session_id: str | None = None) -> Any:
        try:
            if session_id is None:
                raise RequestError(VALIDATION_ERROR, "session_id",
                                   "session_id query parameter is required (the id POST /reset returned)")
            session = sessions.get(session_id)
            sessions.touch(session)  # a state request is activity (idle timeout)
            return session.env.state.model_dump()
        except RequestError as e:
            return error_response(e)

    @app.delete("/sessions/{session_id}")
    async def http_close(session_id: str) -> Any:
        try:
            await sessions.close(sessions.get(session_id))
        except RequestError as e:
            return error_response(e)
        return {"session_id": session_id, "closed": True}

    @app.websocket("/ws")
    async def ws_session(websocket: WebSocket) -> None:
        await WebSocketSession(server, websocket).run()

    return app


class WebSocketSession:
    """One ``/ws`` connection: an OpenEnv session (see the module docstring).

    The connection opens a session (or attaches to the HTTP session ``?session_id=``); each text
    message is answered by one frame; a ``close`` message, a disconnect or the idle timeout ends
    it, and an owned session is closed then (an attached one stays open). A refused connection
    gets an error frame, then a close with code ``4000 + status``.
    """

    def __init__(self, server: ServedEnv, websocket: WebSocket) -> None:
        self.server, self.ws = server, websocket
        self.session: Session | None = None

    async def run(self) -> None:
        """Serve the connection until it ends."""
        sessions = self.server.sessions
        await self.ws.accept()
        owned = False
        try:
            sid = self.ws.query_params.get("session_id")
            try:
                if sid:
                    self.session = sessions.get(sid)
                    if self.session.on_expire is not None:
                        raise RequestError(VALIDATION_ERROR, "session_id",
                                           f"session_id={sid!r} already has a WebSocket attached")
                else:
                    self.session, owned = await sessions.open(), True
            except RequestError as e:
                await self._refuse(e)
                return
            self.session.on_expire = self._expire
            while True:
                msg = await self.ws.receive()
                if msg["type"] == "websocket.disconnect":
                    break
                raw = msg.get("text")
                if raw is None:
                    raw = (msg.get("bytes") or b"").decode("utf-8", errors="replace")
                reply = await self.handle(raw)
                if reply is None:
                    break
                await self.ws.send_text(reply)
        except (WebSocketDisconnect, RuntimeError):
            pass  # the client went away (or the reaper closed the socket)
        finally:
            if self.session is not None:
                self.session.on_expire = None
                if owned:
                    await sessions.close(self.session)
            if self.ws.application_state != WebSocketState.DISCONNECTED:
                # the client may be gone already (closing its session's environment takes time):
                # the ASGI server then raises WebSocketDisconnect, which must not reach it
                with contextlib.suppress(RuntimeError, WebSocketDisconnect):
                    await self.ws.close()

    async def _refuse(self, e: RequestError) -> None:
        await self.ws.send_text(json.dumps({"type": "error", "data": e.data()}))
        await self.ws.close(code=CLOSE_CODE_BASE + e.status, reason=e.code)

    async def _expire(self) -> None:
        """Called by the reaper: tell the client, then disconnect."""
        err = expire_message(self.server.sessions.idle_timeout_s)
        with contextlib.suppress(RuntimeError):
            await self._refuse(err)

    async def handle(self, raw: str) -> str | None:
        """The reply frame to one message (``None`` for ``close``)."""
        session = self.session
        assert session is not None
        op = "message"
        try:
            try:
                message = json.loads(raw)
            except json.JSONDecodeError as e:
                raise RequestError(INVALID_JSON, "message", f"message is not valid JSON: {e}") from None
            except RecursionError:
                raise RequestError(INVALID_JSON, "message", f"message {NESTED_TOO_DEEP}") from None
            except ValueError as e:
                raise RequestError(INVALID_JSON, "message", f"message {unparsable(e)}") from None
            if not isinstance(message, dict):
                raise RequestError(VALIDATION_ERROR, "message",
                                   f"message must be a JSON object, got {type(message).__name__}")
            op = message.get("type")
            if op == "reset":
                try:
                    data = WSResetMessage.model_validate(message).data
                except ValidationError as e:
                    raise validation_error(e, "") from None
                check_reset_args(data, "data.")
                obs = await self.server.sessions.run(session, functools.partial(session.env.reset, **data))
                return json.dumps({"type": "observation", "data": observation_payload(obs, session)})
            if op == "step":
                try:
                    data = WSStepMessage.model_validate(message).data
                except ValidationError as e:
                    raise validation_error(e, "") from None
                try:
                    action = TextAction.model_validate(data)
                except ValidationError as e:
                    raise validation_error(e, "data") from None
                obs = await self.server.sessions.run(session, session.env.step, action)
                return json.dumps({"type": "observation", "data": observation_payload(obs)})
            if op == "state":
                self.server.sessions.touch(session)  # activity (idle timeout)
                return json.dumps({"type": "state", "data": session.env.state.model_dump()})
            if op == "close":
                return None
            raise RequestError(UNKNOWN_TYPE, "type",
                               f"type={op!r}: unknown message type; expected reset, step, state or close")
        except Exception as e:
            return json.dumps({"type": "error", "data": as_request_error(e, str(op)).data()})


__all__ = ["RESET_ARGS", "WebSocketSession", "as_request_error", "build_app", "check_reset_args", "read_json",
           "validation_error"]
