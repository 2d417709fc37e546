"""Wire constants of the OpenEnv protocol as COPC speaks it, with no third-party imports.

Both sides use them: the server (:mod:`environments.remote.server`, which needs the ``openenv``
extra) and the client (:mod:`environments.remote.client`, which needs only ``websockets`` and
``httpx``).

Errors. Every refused request gets an error naming the field at fault: over HTTP a 4xx/5xx
status with body ``{"detail": message, "code": CODE, "field": FIELD}``; over the ``/ws``
WebSocket an OpenEnv error frame ``{"type": "error", "data": {"message", "code", "status",
"field"}}`` (``status`` is the HTTP status the same request gets over HTTP). The codes extend
OpenEnv's ``WSErrorCode`` (``INVALID_JSON``, ``UNKNOWN_TYPE``, ``VALIDATION_ERROR``,
``CAPACITY_REACHED``, ``EXECUTION_ERROR``, ``SESSION_ERROR`` keep their meaning) with the
ones below; ``INFRASTRUCTURE_ERROR`` is how an
:class:`~environments.errors.InfrastructureError` raised inside the served environment reaches
the client, which raises it again (never a reward of 0).

Schema extensions. ``GET /schema`` returns OpenEnv's ``SchemaResponse``; the action schema
carries ``properties.text.maxLength`` (the longest action accepted, characters) and
:data:`X_STOP_STRINGS` (the environment's ``stop_strings``, which a rollout engine needs to end
a model turn), and :data:`X_ENV_ID` (the served environment's registered id).
"""

from __future__ import annotations

from typing import Any

#: Action-schema key listing the environment's stop strings (JSON array of str).
X_STOP_STRINGS = "x-copc-stop-strings"
#: Action-schema key naming the served environment's registered id (str).
X_ENV_ID = "x-copc-env"
#: WebSocket close code of a session ended by the server = this + the HTTP status (e.g. 4408).
CLOSE_CODE_BASE = 4000

# Error codes (``data.code`` of an error frame, ``code`` of an HTTP error body) and their status.
INVALID_JSON = "INVALID_JSON"
UNKNOWN_TYPE = "UNKNOWN_TYPE"
VALIDATION_ERROR = "VALIDATION_ERROR"
PAYLOAD_TOO_LARGE = "PAYLOAD_TOO_LARGE"
UNKNOWN_SESSION = "UNKNOWN_SESSION"
EPISODE_OVER = "EPISODE_OVER"
IDLE_TIMEOUT = "IDLE_TIMEOUT"
CAPACITY_REACHED = "CAPACITY_REACHED"
INFRASTRUCTURE_ERROR = "INFRASTRUCTURE_ERROR"
EXECUTION_ERROR = "EXECUTION_ERROR"
FACTORY_ERROR = "FACTORY_ERROR"
UNAUTHORIZED = "UNAUTHORIZED"
FORBIDDEN = "FORBIDDEN"

STATUS: dict[str, int] = {
    INVALID_JSON: 400, UNKNOWN_TYPE: 400, VALIDATION_ERROR: 422, PAYLOAD_TOO_LARGE: 413,
    UNKNOWN_SESSION: 404, EPISODE_OVER: 409, IDLE_TIMEOUT: 408, CAPACITY_REACHED: 503,
    INFRASTRUCTURE_ERROR: 503, EXECUTION_ERROR: 500, FACTORY_ERROR: 500, UNAUTHORIZED: 401,
    FORBIDDEN: 403,
}


class RequestError(Exception):
    """A request the server refuses (or could not serve), with the field at fault.

    Args:
        code: one of the error codes of this module (its HTTP status is :data:`STATUS`).
        field: the request field at fault, dotted (``"data.text"``, ``"session_id"``,
            ``"Authorization"``), or ``""`` when no single field is.
        message: what is wrong and what to do, naming ``field`` and the value.

    Raises:
        ValueError: unknown ``code``.
    """

    def __init__(self, code: str, field: str, message: str) -> None:
        if code not in STATUS:
            raise ValueError(f"RequestError: unknown code {code!r}; known: {sorted(STATUS)}")
        super().__init__(message)
        self.code, self.field, self.message = code, field, message

    @property
    def status(self) -> int:
        """The HTTP status of this error (400-599)."""
        return STATUS[self.code]

    def data(self) -> dict[str, Any]:
        """The ``data`` of an OpenEnv error frame: ``message``, ``code``, ``status``, ``field``."""
        return {"message": self.message, "code": self.code, "status": self.status, "field": self.field}

    def http_body(self) -> dict[str, Any]:
        """The JSON body of the HTTP error response: ``detail``, ``code``, ``field``."""
        return {"detail": self.message, "code": self.code, "field": self.field}
