"""``RemoteEnv``: a ``gymnasium.Env`` whose episodes run on an OpenEnv server.

``environments.make("remote", url="http://127.0.0.1:8100")`` (``task.env: remote`` with
``task.env_kwargs.url``) drives any OpenEnv server over its ``/ws`` WebSocket session protocol:
COPC's (``copc env serve``) or another one. Needs ``websockets`` and ``httpx`` only.

One session per episode: ``reset`` opens a new WebSocket session (closing the previous one) and
sends ``{"type": "reset", "data": {"seed", "sample", "options"}}``; each ``step`` sends
``{"type": "step", "data": {"text": action}}``; the session is closed as soon as the episode is
over (or by ``close``), so the server frees it at once.

Failures. Connecting and resetting are retried (``retries`` more attempts, exponential backoff
from ``backoff_s``): a refused connection, a handshake or reply timeout, a dropped connection, a
server at capacity, a 5xx. A step is never retried (it is not idempotent; the episode's state is
on the server): a timeout, a lost connection or session, a 5xx or an
:class:`~environments.errors.InfrastructureError` of the remote environment (the server's
``INFRASTRUCTURE_ERROR``) raise :class:`~environments.errors.InfrastructureError`, so the trainer
and evaluation count the episode as an infrastructure failure (never reward 0). Requests the
server refuses as bad (4xx) raise ``ValueError`` / ``RuntimeError`` as the in-process environment
would (``RuntimeError`` for a step after the episode ended).

Stop strings and limits come from the server's ``GET /schema``: the action schema's
``x-copc-stop-strings`` and ``properties.<text field>.maxLength`` (COPC servers publish both).
For other OpenEnv servers the action's text field is ``action_field`` (default: ``text``, else the
schema's only required string property), the observation text is ``observation_field`` (default:
``text``, else the observation as JSON), and ``stop_strings`` can be given.
"""

from __future__ import annotations

import contextlib
import json
import time
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import gymnasium

from ..base import TextSpace
from ..errors import InfrastructureError
from .wire import X_ENV_ID, X_STOP_STRINGS


@dataclass(frozen=True)
class RemoteEnvConfig:
    """Settings of :class:`RemoteEnv` (validated).

    Attributes:
        url: the server's base URL (``http(s)://host:port`` or ``ws(s)://host:port``).
        token_file: a file holding the server's bearer token (``Authorization: Bearer``).
        token: the token itself (prefer ``token_file``: configs get logged).
        remote_env: the environment id the server must serve (checked against its schema /
            metadata; also picks the training task's data, see ``trainer/tasks/remote.py``).
        connect_timeout_s: TCP + WebSocket handshake timeout (seconds).
        read_timeout_s: longest wait for a reply (seconds; a step may run code or a search).
        retries: further attempts when connecting or resetting fails (>= 0).
        backoff_s: wait before the first retry, doubled after each (seconds).
        max_message_mb: largest message accepted from the server (MiB).
        action_field / observation_field: the text fields of actions / observations on servers
            that do not use ``text`` (``""``: detect from ``GET /schema``).
        stop_strings: stop strings when the server does not publish them (``x-copc-stop-strings``).
    """

    url: str
    token_file: str | None = None
    token: str | None = None
    remote_env: str | None = None
    connect_timeout_s: float = 10.0
    read_timeout_s: float = 300.0
    retries: int = 3
    backoff_s: float = 0.25
    max_message_mb: float = 64.0
    action_field: str = ""
    observation_field: str = ""
    stop_strings: tuple[str, ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        def bad(name: str, want: str) -> None:
            raise ValueError(f"RemoteEnvConfig.{name}={getattr(self, name)!r}: {want}")

        parts = urlsplit(self.url) if isinstance(self.url, str) else None
        if parts is None or parts.scheme not in ("http", "https", "ws", "wss") or not parts.hostname:
            bad("url", "must be http(s)://host:port or ws(s)://host:port of an OpenEnv server")
        for name in ("connect_timeout_s", "read_timeout_s", "max_message_mb"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int | float) or not v > 0:
                bad(name, "must be a number > 0")
        b = self.backoff_s
        if isinstance(b, bool) or not isinstance(b, int | float) or b < 0:
            bad("backoff_s", "must be a number >= 0 (seconds)")
        if isinstance(self.retries, bool) or not isinstance(self.retries, int) or self.retries < 0:
            bad("retries", "must be an int >= 0")
        if self.token is not None and self.token_file is not None:
            bad("token", "give token or token_file, not both")
        if isinstance(self.stop_strings, str) or not all(isinstance(s, str) and s for s in self.stop_strings):
            bad("stop_strings", "must be a list of non-empty strings")
        object.__setattr__(self, "stop_strings", tuple(self.stop_strings))

    @property
    def http_url(self) -> str:
        """The base URL with an ``http(s)`` scheme, no trailing slash."""
        p = urlsplit(self.url)
        scheme = {"ws": "http", "wss": "https"}.get(p.scheme, p.scheme)
        return urlunsplit((scheme, p.netloc, p.path.rstrip("/"), "", ""))

    @property
    def ws_url(self) -> str:
        """The ``/ws`` session URL with a ``ws(s)`` scheme."""
        p = urlsplit(self.http_url)
        return urlunsplit(({"http": "ws", "https": "wss"}[p.scheme], p.netloc, p.path + "/ws", "", ""))

    def token_field(self) -> str:
        """``RemoteEnvConfig.<field>=<value>`` of the token setting in use (for messages; a token
        itself is never shown)."""
        if self.token is not None:
            return "RemoteEnvConfig.token=<hidden>"
        return f"RemoteEnvConfig.token_file={self.token_file!r}"

    def bearer_token(self) -> str | None:
        """The token (read from ``token_file`` if given).

        Raises:
            ValueError: unreadable or empty token file (naming ``RemoteEnvConfig.token_file``).
        """
        if self.token_file is not None:
            from .auth import read_token_file

            return read_token_file(self.token_file, "RemoteEnvConfig.token_file")
        return self.token


@dataclass(frozen=True)
class ServerInfo:
    """What :func:`fetch_server_info` learnt from ``GET /schema`` (and ``/metadata``).

    Attributes:
        env_id: the served environment's id (``""`` if the server does not say).
        action_field / observation_field: the text fields (``observation_field`` ``""``: the
            observation is rendered as JSON).
        max_action_chars / max_observation_chars: the text length limits (characters).
        stop_strings: the environment's stop strings.
    """

    env_id: str
    action_field: str
    observation_field: str
    max_action_chars: int
    max_observation_chars: int
    stop_strings: tuple[str, ...]


def _text_field(schema: dict[str, Any], wanted: str, config_key: str, required: bool) -> str:
    """The text property of an action / observation ``schema``: ``wanted`` if given, else
    ``text``, else the only required string property."""
    props = schema.get("properties", {}) if isinstance(schema, dict) else {}
    if wanted:
        if props and wanted not in props:
            raise ValueError(f"RemoteEnvConfig.{config_key}={wanted!r}: not a field of the server's schema "
                             f"(fields: {sorted(props)})")
        return wanted
    if "text" in props:
        return "text"
    strings = [k for k in schema.get("required", []) if props.get(k, {}).get("type") == "string"]
    if len(strings) == 1:
        return strings[0]
    if required:
        raise ValueError(f"RemoteEnvConfig.{config_key}: the server's action schema has no 'text' field and "
                         f"not exactly one required string field ({sorted(props)}); name it")
    return ""


def _max_length(schema: dict[str, Any], name: str, default: int) -> int:
    n = schema.get("properties", {}).get(name, {}).get("maxLength") if name else None
    return int(n) if isinstance(n, int) and n > 0 else default


def _headers(token: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"} if token else {}


def fetch_server_info(cfg: RemoteEnvConfig, token: str | None) -> ServerInfo:
    """Ask the server for its schema (retrying like a reset) and derive :class:`ServerInfo`.

    Raises:
        InfrastructureError: no answer after ``cfg.retries`` retries, or a 5xx.
        ValueError: the server refuses the token (401/403, naming ``token_file``), is not an
            OpenEnv server (no ``/schema``), serves another environment than ``remote_env``, or
            its action schema has no text field to use.
    """
    import httpx

    last: Exception | None = None
    schema: dict[str, Any] | None = None
    with httpx.Client(timeout=httpx.Timeout(cfg.read_timeout_s, connect=cfg.connect_timeout_s),
                      headers=_headers(token), trust_env=False) as http:
        for attempt in range(cfg.retries + 1):
            if attempt:
                time.sleep(cfg.backoff_s * 2 ** (attempt - 1))
            try:
                r = http.get(f"{cfg.http_url}/schema")
            except httpx.HTTPError as e:
                last = e
                continue
            if r.status_code in (401, 403):
                raise ValueError(f"{cfg.token_field()}: {cfg.http_url} refused the "
                                 f"request (HTTP {r.status_code}: {_detail(r.text)})")
            if r.status_code >= 500:
                last = RuntimeError(f"HTTP {r.status_code}: {_detail(r.text)}")
                continue
            if r.status_code != 200:
                raise ValueError(f"RemoteEnvConfig.url={cfg.url!r}: GET /schema answered HTTP "
                                 f"{r.status_code}; is this an OpenEnv server?")
            schema = r.json()
            break
        if schema is None:
            raise InfrastructureError(f"remote env {cfg.http_url}: GET /schema failed after "
                                      f"{cfg.retries + 1} attempts: {type(last).__name__}: {last}")
        action = schema.get("action", {})
        env_id = action.get(X_ENV_ID, "")
        if not env_id:
            try:
                env_id = str(http.get(f"{cfg.http_url}/metadata").json().get("name", ""))
            except (httpx.HTTPError, ValueError, AttributeError):
                env_id = ""
    if cfg.remote_env and env_id and cfg.remote_env != env_id:
        raise ValueError(f"RemoteEnvConfig.remote_env={cfg.remote_env!r}: the server at {cfg.http_url} "
                         f"serves {env_id!r}")
    observation = schema.get("observation", {})
    action_field = _text_field(action, cfg.action_field, "action_field", required=True)
    obs_field = _text_field(observation, cfg.observation_field, "observation_field", required=False)
    stops = action.get(X_STOP_STRINGS)
    stop_strings = tuple(stops) if isinstance(stops, list) and not cfg.stop_strings else cfg.stop_strings
    return ServerInfo(env_id, action_field, obs_field, _max_length(action, action_field, 1 << 20),
                      _max_length(observation, obs_field, 1 << 20), stop_strings)


def _error_of(frame: dict[str, Any]) -> dict[str, Any]:
    """The ``data`` of an error frame (a 500-like error for any other unexpected frame)."""
    if frame.get("type") == "error" and isinstance(frame.get("data"), dict):
        return frame["data"]
    return {"message": f"unexpected reply {str(frame)[:200]}", "code": "EXECUTION_ERROR", "status": 500}


def _detail(body: str) -> str:
    try:
        data = json.loads(body)
    except ValueError:
        return body[:300]
    return str(data.get("detail", data)) if isinstance(data, dict) else body[:300]


class RemoteEnv(gymnasium.Env):
    """A text environment served by an OpenEnv server (see the module docstring).

    Args:
        config: :class:`RemoteEnvConfig`; or its fields as keyword arguments.
        server_info: what :func:`fetch_server_info` returned for this config (the training task
            passes it), so that constructing the environment does no network I/O: a server that
            is down then fails the episode's :meth:`reset` (an infrastructure failure of that
            episode) instead of the environment's construction. ``None``: ask the server here.

    Attributes:
        config, server (:class:`ServerInfo`), stop_strings, action_space / observation_space
        (:class:`~environments.base.TextSpace` with the server's limits), session_id (of the
        current episode, or ``None``).

    Raises:
        ValueError: bad settings (naming the field), see :func:`fetch_server_info`.
        InfrastructureError: the server does not answer.
    """

    metadata: dict[str, Any] = {"render_modes": []}  # noqa: RUF012 - gymnasium convention

    def __init__(self, config: RemoteEnvConfig | None = None, *, server_info: ServerInfo | None = None,
                 **overrides: Any) -> None:
        if config is None:
            config = RemoteEnvConfig(**overrides)
        elif overrides:
            from dataclasses import replace

            config = replace(config, **overrides)
        self.config = config
        self._token = config.bearer_token()
        if server_info is not None and not isinstance(server_info, ServerInfo):
            raise ValueError(f"RemoteEnv: server_info={server_info!r} must be a ServerInfo or None")
        self.server = server_info or fetch_server_info(config, self._token)
        self.stop_strings: tuple[str, ...] = self.server.stop_strings
        self.action_space = TextSpace(self.server.max_action_chars)
        self.observation_space = TextSpace(self.server.max_observation_chars)
        self.session_id: str | None = None
        self._ws: Any = None

    # -- connection ----------------------------------------------------------------------------
    def _connect(self) -> Any:
        from websockets.sync.client import connect

        ws = connect(self.config.ws_url, open_timeout=self.config.connect_timeout_s,
                     close_timeout=min(self.config.connect_timeout_s, 2.0),
                     additional_headers=_headers(self._token), compression=None, proxy=None,
                     max_size=int(self.config.max_message_mb * (1 << 20)))
        # websockets >= 17.1 wants the connection used as a context manager (closed in _drop_session)
        return ws.__enter__()

    def _exchange(self, message: dict[str, Any]) -> dict[str, Any]:
        """Send ``message`` on the session's socket and return the reply frame (a server refusing
        the session sends an error frame and closes: that frame is returned)."""
        from websockets.exceptions import ConnectionClosed

        with contextlib.suppress(ConnectionClosed):  # then recv() returns a frame sent before the close
            self._ws.send(json.dumps(message))
        raw = self._ws.recv(timeout=self.config.read_timeout_s)
        frame = json.loads(raw)
        if not isinstance(frame, dict):
            raise ValueError(f"reply is not a JSON object: {raw[:200]!r}")
        return frame

    def _drop_session(self) -> None:
        """Close the session's socket (an OpenEnv server ends a session when its socket closes)."""
        ws, self._ws, self.session_id = self._ws, None, None
        if ws is None:
            return
        with contextlib.suppress(Exception):  # the socket is gone either way
            ws.close()

    # -- gymnasium API -------------------------------------------------------------------------
    def reset(self, *, seed: int | None = None,
              options: dict[str, Any] | None = None) -> tuple[str, dict[str, Any]]:
        """Open a new session and start an episode on ``options["sample"]``.

        Args:
            seed: passed to the remote ``reset``. options: gymnasium options; ``"sample"`` (the
                data row) and the rest are sent as ``data.sample`` / ``data.options``.

        Returns:
            ``(prompt text, info)``.

        Raises:
            InfrastructureError: no session after ``retries`` retries (refused connection,
                timeout, capacity, 5xx, remote infrastructure failure).
            ValueError: the server refused the reset as bad (4xx: e.g. the sample).
        """
        super().reset(seed=seed)
        self._drop_session()
        opts = dict(options or {})
        data: dict[str, Any] = {}
        if seed is not None:
            data["seed"] = seed
        if "sample" in opts:
            data["sample"] = opts.pop("sample")
        if opts:
            data["options"] = opts
        from websockets.exceptions import InvalidStatus, WebSocketException

        last: str = ""
        for attempt in range(self.config.retries + 1):
            if attempt:
                time.sleep(self.config.backoff_s * 2 ** (attempt - 1))
            try:
                self._ws = self._connect()
                frame = self._exchange({"type": "reset", "data": data})
            except InvalidStatus as e:
                self._drop_session()
                status = e.response.status_code
                if status in (401, 403):
                    why = _detail(e.response.body.decode(errors="replace"))
                    raise ValueError(f"{self.config.token_field()}: the server "
                                     f"refused the session (HTTP {status}: {why})") from None
                last = f"handshake refused with HTTP {status}"
                continue
            except (OSError, TimeoutError, WebSocketException, ValueError) as e:
                self._drop_session()
                last = f"{type(e).__name__}: {e}"
                continue
            if frame.get("type") == "observation":
                obs, _, _, _, info = self._parse(frame.get("data", {}))
                self.session_id = (frame["data"].get("metadata") or {}).get("session_id")
                return obs, info
            self._drop_session()
            err = _error_of(frame)
            status = int(err.get("status") or 500)
            if status < 500:
                raise ValueError(f"remote env {self.config.http_url}: reset refused (HTTP {status} "
                                 f"{err.get('code')}, field {err.get('field')!r}): {err.get('message')}")
            last = f"{err.get('code', 'error')}: {err.get('message')}"
        raise InfrastructureError(f"remote env {self.config.http_url}: reset failed after "
                                  f"{self.config.retries + 1} attempts: {last}")

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        """Send one model turn; the session is closed once the episode is over.

        Returns:
            ``(observation, reward, terminated, truncated, info)`` as the served environment's.

        Raises:
            RuntimeError: no episode (``reset`` not called, or the episode is over).
            TypeError: ``action`` is not a str. ValueError: ``action`` is longer than the
                server accepts, or the server refused it as bad (4xx).
            InfrastructureError: timeout, lost connection or session, 5xx, or an infrastructure
                failure of the remote environment (never retried).
        """
        if self._ws is None:
            raise RuntimeError("step() called before reset() or after the episode ended")
        if not isinstance(action, str):
            raise TypeError(f"action must be str, got {type(action).__name__}")
        if len(action) > self.action_space.max_length:
            raise ValueError(f"action has {len(action)} characters, more than the remote env accepts "
                             f"({self.action_space.max_length}, its action schema's maxLength)")
        from websockets.exceptions import WebSocketException

        try:
            frame = self._exchange({"type": "step", "data": {self.server.action_field: action}})
        except (OSError, TimeoutError, WebSocketException, ValueError) as e:
            self._drop_session()
            what = "no reply within read_timeout_s" if isinstance(e, TimeoutError) else "connection lost"
            raise InfrastructureError(f"remote env {self.config.http_url}: step: {what} "
                                      f"({type(e).__name__}: {e}); the session is gone") from e
        if frame.get("type") != "observation":
            err = _error_of(frame)
            status = int(err.get("status") or 500)
            msg = (f"remote env {self.config.http_url}: step refused (HTTP {status} {err.get('code')}, "
                   f"field {err.get('field')!r}): {err.get('message')}")
            if status >= 500 or status == 408 or err.get("code") in ("INFRASTRUCTURE_ERROR", "SESSION_ERROR"):
                self._drop_session()
                raise InfrastructureError(msg)
            if status == 409:
                self._drop_session()
                raise RuntimeError(msg)
            raise ValueError(msg)
        obs, reward, terminated, truncated, info = self._parse(frame.get("data", {}))
        if terminated or truncated:
            self._drop_session()
        return obs, reward, terminated, truncated, info

    def _parse(self, data: dict[str, Any]) -> tuple[str, float, bool, bool, dict[str, Any]]:
        """A serialized OpenEnv observation as gymnasium's step tuple."""
        body = data.get("observation", {})
        if not isinstance(body, dict):
            raise InfrastructureError(f"remote env {self.config.http_url}: malformed observation "
                                      f"{str(data)[:200]}")
        name = self.server.observation_field
        if name:
            text = str(body.get(name, ""))
        else:
            text = json.dumps({k: v for k, v in body.items() if k != "metadata"}, sort_keys=True)
        done = bool(data.get("done", False))
        truncated = bool(body.get("truncated", False))
        terminated = bool(body.get("terminated", done and not truncated))
        info = body.get("info")
        if not isinstance(info, dict):
            info = {**(body.get("metadata") or {}), **(data.get("metadata") or {})}
        reward = data.get("reward")
        return text, float(reward) if reward is not None else 0.0, terminated, truncated, info

    def close(self) -> None:
        """Close the current session, if any (the server frees it at once)."""
        self._drop_session()


__all__ = ["RemoteEnv", "RemoteEnvConfig", "ServerInfo", "fetch_server_info"]
