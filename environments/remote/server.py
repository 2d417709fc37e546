"""``copc env serve``: any registered environment behind an OpenEnv server (``openenv`` extra).

Why COPC's own FastAPI app rather than OpenEnv's ``create_app`` / ``HTTPEnvServer`` (0.10.0):
the app speaks the same protocol with OpenEnv's own message and schema types (its ``Action`` /
``Observation`` / ``State`` models, ``WS*Message`` / ``WS*Response`` frames, ``ResetRequest`` /
``StepRequest`` bodies, ``SchemaResponse``, ``HealthResponse``, ``EnvironmentMetadata``,
``serialize_observation``) and is driven by OpenEnv's ``EnvClient`` unchanged, but
``HTTPEnvServer`` does not meet this server's requirements: an idle ``/ws`` session it reaps is
closed under a socket that stays open (later steps reach a closed environment), its reaper looks
no more often than every 5 s, every exception an environment raises becomes one
``EXECUTION_ERROR`` (an infrastructure failure cannot be told from a bug or a bad request), its
stateless HTTP ``/step`` builds a fresh environment per call (a 500 for a multi-turn environment
that was never reset), and it has no request size limit or access control.

What this server adds: sessions (:mod:`.sessions`) bounded by ``max_sessions``, closed when their
``/ws`` connection ends or after ``idle_timeout_s`` without a request, with environments reused
between sessions; HTTP sessions as an extension (``POST /reset`` returns ``metadata.session_id``;
``POST /step`` / ``GET /state`` name it; ``DELETE /sessions/{id}``; a ``/ws?session_id=`` client
attaches to one, as in OpenEnv); request size limits; a bearer token (:mod:`.auth`), required for
any non-loopback address, and without one the ``Host`` / ``Origin`` check (a loopback ``Host``; an
``Origin`` only the server's own or a configured one: cross-site WebSocket hijacking, other local
pages, DNS rebinding); errors naming the field (:mod:`.wire`). Environments taking a
``sandbox`` argument (``math_tool``) share one sandbox pool of ``sandbox_workers`` workers.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import environments

from .adapter import GymTextEnvironment, space_max_length
from .auth import protect
from .config import DEFAULT_PORT, ServerConfig
from .protocol import action_schema, observation_schema
from .routes import build_app
from .sessions import SessionManager

log = logging.getLogger(__name__)

#: Most bytes one action character takes in a JSON message: a character outside the Basic
#: Multilingual Plane, ASCII-escaped as a surrogate pair (``\ud83d\ude00``) as Python's ``json``
#: writes it by default.
MAX_JSON_BYTES_PER_CHAR = 12


class EnvServer:
    """A started environment server (not yet listening): its app, sessions and services.

    Construction resolves the environment, starts shared services, builds one environment (to
    check ``env_kwargs`` and read its limits and stop strings; it serves the first session) and
    the ASGI app. Close with :meth:`close` (the app's shutdown does it too).

    Args:
        cfg: :class:`ServerConfig`.

    Attributes:
        cfg, env_id, stop_strings, max_action_chars, max_observation_chars, max_request_bytes,
        sessions (:class:`SessionManager`), app (the ASGI app behind :func:`~.auth.protect`: the
        token check with a token, the ``Host`` / ``Origin`` check without).

    Raises:
        ValueError: unknown environment, or settings it rejects (the message names them).
        Whatever starting a shared sandbox raises (``SandboxUnavailableError``).
    """

    def __init__(self, cfg: ServerConfig) -> None:
        self.cfg = cfg
        try:
            self.env_id = environments.resolve(cfg.env)
        except (KeyError, ImportError, OSError, ValueError) as e:
            raise ValueError(f"--env={cfg.env!r}: {e.args[0] if e.args else e}") from None
        self._closers: list[Any] = []
        kwargs = dict(cfg.env_kwargs)
        spec = environments.DEFAULT_REGISTRY.spec(self.env_id)
        if _takes_sandbox(spec) and "sandbox" not in kwargs and "sandbox" not in spec.defaults:
            from environments.sandbox import Sandbox, SandboxConfig

            sandbox = Sandbox(SandboxConfig(workers=cfg.sandbox_workers, isolation=cfg.sandbox_isolation))
            self._closers.append(sandbox.close)
            kwargs["sandbox"] = sandbox
        self._kwargs = kwargs
        try:
            probe = self._make()
        except (TypeError, ValueError, OSError) as e:
            self.close()
            raise ValueError(f"env {self.env_id!r} rejected its settings {cfg.env_kwargs!r}: "
                             f"{type(e).__name__}: {e}") from e
        except BaseException:
            self.close()
            raise
        self.stop_strings = probe.stop_strings
        self.max_action_chars = probe.max_action_chars
        self.max_observation_chars = space_max_length(probe.env.observation_space, 1 << 20)
        # so that a longest action always arrives (and a longer one is refused by name, 413)
        per_char = MAX_JSON_BYTES_PER_CHAR
        self.max_request_bytes = cfg.max_request_bytes or per_char * self.max_action_chars + 65536
        self.metadata = probe.get_metadata()
        self.schema = {"action": action_schema(self.max_action_chars, self.stop_strings, self.env_id),
                       "observation": observation_schema(self.max_observation_chars),
                       "state": type(probe.state).model_json_schema()}
        self.schema["reset_observation"] = self.schema["observation"]
        threads = cfg.threads or min(cfg.max_sessions + 4, 1024)
        self.executor = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="copc-env")
        self._closers.append(lambda: self.executor.shutdown(wait=False, cancel_futures=True))
        self.sessions = SessionManager(self._make, cfg.max_sessions, cfg.idle_timeout_s, cfg.reuse_envs,
                                       self.executor)
        self.sessions.add_idle_env(probe)
        app = build_app(self)
        self.app = protect(app, cfg.host, cfg.token, cfg.allowed_origins)

    def _make(self) -> GymTextEnvironment:
        env = environments.make(self.env_id, **self._kwargs)
        return GymTextEnvironment(env, self.env_id)

    @contextlib.asynccontextmanager
    async def lifespan(self, app: Any) -> AsyncIterator[None]:
        """The app's lifespan: the idle-session reaper runs while it serves; on shutdown every
        session and service is closed."""
        import asyncio

        reaper = asyncio.create_task(self.sessions.reap_forever())
        try:
            yield
        finally:
            reaper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await reaper
            await self.sessions.shutdown()
            self.close()

    def close(self) -> None:
        """Stop the shared services and worker threads (idempotent)."""
        while self._closers:
            fn = self._closers.pop()
            try:
                fn()
            except Exception:
                log.warning("a service of the environment server failed to stop", exc_info=True)


def _takes_sandbox(spec: Any) -> bool:
    """Whether the environment's constructor has a ``sandbox`` parameter."""
    try:
        return "sandbox" in inspect.signature(spec.load()).parameters
    except (TypeError, ValueError, ImportError, AttributeError):
        return False


def serve(cfg: ServerConfig, *, ready_message: bool = True) -> None:
    """Serve ``cfg.env`` until interrupted (SIGINT / SIGTERM close every session first).

    Args:
        cfg: :class:`ServerConfig`. ready_message: print the URL on stderr once built.

    Raises:
        ValueError: see :class:`EnvServer`.
    """
    import sys

    import uvicorn

    server = EnvServer(cfg)
    config = uvicorn.Config(server.app, host=cfg.host, port=cfg.port, log_level=cfg.log_level,
                            ws_max_size=server.max_request_bytes, ws_ping_interval=20.0, ws_ping_timeout=20.0,
                            lifespan="on", timeout_graceful_shutdown=5, backlog=4096)
    if ready_message:
        auth = "bearer token required" if cfg.token else "no token (loopback only)"
        print(f"serving env {server.env_id!r} (OpenEnv protocol) on http://{cfg.host}:{cfg.port} "
              f"[{auth}; max {cfg.max_sessions} sessions, idle timeout {cfg.idle_timeout_s:g} s]",
              file=sys.stderr, flush=True)
    try:
        uvicorn.Server(config).run()
    finally:
        server.close()


__all__ = ["DEFAULT_PORT", "EnvServer", "ServerConfig", "serve"]
