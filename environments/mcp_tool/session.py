"""A synchronous handle on one MCP server: :class:`McpSession` owns an ``mcp.ClientSession``
on its own event-loop thread and offers a thread-safe, blocking :meth:`McpSession.call`.

The ``mcp`` client is asynchronous (anyio); our environments are synchronous Gymnasium envs
stepped from worker threads (``trainer/rollout/groups.py``). One session per server runs on a
private asyncio loop in a daemon thread; any number of threads (environments) submit tool
calls to it concurrently (JSON-RPC request ids keep them apart). Transports: stdio (the server
is spawned as a subprocess; the MCP stdio shutdown sequence — close stdin, wait, SIGTERM,
SIGKILL — reaps it on :meth:`McpSession.close`) and streamable HTTP.

Failure semantics (see ``environments/errors.py``): a server that cannot be reached, dies, or
does not answer within the per-call timeout raises :class:`InfrastructureError` (never a
reward); a tool's own error (``CallToolResult.isError``, or the server rejecting the
arguments with JSON-RPC ``-32602 Invalid params``) is a normal :class:`McpResult` with
``is_error=True`` that the environment shows to the policy.

Tested with ``mcp`` 1.30; field and function names that changed in ``mcp`` 2.x
(``input_schema``/``is_error``/``structured_content``, ``MCPError``, the 2-tuple
``streamable_http_client``) are looked up under both spellings, but 2.x is not tested here
(the ``openenv`` extra pins ``mcp<2``).
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import contextlib
import logging
import threading
from collections.abc import Mapping
from typing import Any

from ..errors import InfrastructureError
from .servers import HttpServer, McpResult, McpToolInfo, StdioServer, content_text, mcp_field
from .stdio import RESULT_TOO_LARGE, StreamState, capped_stdio_client

log = logging.getLogger(__name__)

#: JSON-RPC "Invalid params": the server rejected the policy's arguments (not an infra failure).
INVALID_PARAMS = -32602
#: Default cap on one result (bytes of its JSON-RPC message; :class:`McpSession`).
DEFAULT_MAX_RESULT_BYTES = 4 << 20
#: Seconds a session that timed out or sent an oversized result has to answer a ping on
#: :meth:`McpSession.check` before it is declared wedged.
PING_TIMEOUT_S = 5.0


def _mcp_error_type() -> type[Exception]:
    """The SDK's protocol error class (``McpError`` in 1.x, ``MCPError`` in 2.x)."""
    from mcp.shared import exceptions

    return getattr(exceptions, "McpError", None) or exceptions.MCPError


@contextlib.asynccontextmanager
async def _transport(server: StdioServer | HttpServer, max_result_bytes: int):
    """Yield the ``(read_stream, write_stream, state)`` of ``server``'s transport (stdio: the
    capped reader of :mod:`.stdio`; HTTP: the ``mcp`` package's client, ``state`` idle)."""
    if isinstance(server, StdioServer):
        async with capped_stdio_client(server, max_result_bytes) as streams:
            yield streams
        return
    from mcp.client import streamable_http as sh

    if hasattr(sh, "streamable_http_client"):  # mcp >= 1.24 and 2.x
        from mcp.shared._httpx_utils import create_mcp_http_client

        async with create_mcp_http_client(headers=dict(server.headers or {})) as client, \
                sh.streamable_http_client(server.url, http_client=client) as streams:
            yield streams[0], streams[1], StreamState()
    else:  # older 1.x
        async with sh.streamablehttp_client(server.url, headers=dict(server.headers or {})) as streams:
            yield streams[0], streams[1], StreamState()


async def _list_tools(session: Any) -> list[McpToolInfo]:
    """All pages of ``tools/list``."""
    from mcp import types

    out: list[McpToolInfo] = []
    cursor = None
    while True:
        page = await (session.list_tools() if cursor is None else
                      session.list_tools(params=types.PaginatedRequestParams(cursor=cursor)))
        for t in page.tools:
            out.append(McpToolInfo(t.name, t.description or "",
                                   dict(mcp_field(t, "input_schema", "inputSchema", None) or {})))
        cursor = mcp_field(page, "next_cursor", "nextCursor")
        if not cursor:
            return out


class McpSession:
    """One connected MCP server, usable from any number of threads.

    Connects (spawning the server for :class:`StdioServer`), runs ``initialize`` and lists the
    tools in the constructor. Use as a context manager or call :meth:`close`; an unclosed
    session is closed at interpreter exit.

    Args:
        server: :class:`StdioServer` or :class:`HttpServer`.
        connect_timeout_s: seconds allowed for starting, ``initialize`` and ``tools/list``.
        max_result_bytes: cap on one result (default 4 MiB): over stdio, the bytes of its
            JSON-RPC message, never read past the cap (:mod:`.stdio`); over HTTP, the result's
            text once it arrived. A result over it is a tool error naming the cap.

    Raises:
        ValueError: bad ``server`` type or ``connect_timeout_s``; a stdio ``command`` that does
            not exist or is not executable.
        ImportError: the ``mcp`` package is missing (``pip install copc[mcp]``).
        InfrastructureError: the server could not be started or reached in time (or exited).
    """

    def __init__(self, server: StdioServer | HttpServer, connect_timeout_s: float = 30.0,
                 max_result_bytes: int = DEFAULT_MAX_RESULT_BYTES) -> None:
        if isinstance(max_result_bytes, bool) or not isinstance(max_result_bytes, int) \
                or max_result_bytes < 1:
            raise ValueError(f"McpSession: max_result_bytes={max_result_bytes!r} must be an int >= 1 (bytes)")
        if not isinstance(server, StdioServer | HttpServer):
            raise ValueError(f"McpSession: server={server!r} must be a StdioServer or HttpServer")
        if not isinstance(connect_timeout_s, int | float) or not connect_timeout_s > 0:
            raise ValueError(f"McpSession: connect_timeout_s={connect_timeout_s!r} must be a number > 0")
        try:
            import mcp  # noqa: F401
        except ImportError as e:
            raise ImportError("MCP tools need the 'mcp' package: pip install 'copc[mcp]'") from e
        self.server, self.max_result_bytes = server, max_result_bytes
        self._stream = StreamState()
        self._suspect = False  # a call timed out or was over the cap since the last check()
        self._failure: str | None = None
        self._closed = False
        self._lock = threading.Lock()
        self._session: Any = None
        self._stop: asyncio.Event | None = None
        self._owner_task: asyncio.Task | None = None
        self._owner_done = threading.Event()
        self._dead: asyncio.Event | None = None
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True,
                                        name=f"mcp-session:{server.label[:40]}")
        self._thread.start()
        ready: concurrent.futures.Future[list[McpToolInfo]] = concurrent.futures.Future()
        self._owner = asyncio.run_coroutine_threadsafe(self._own(ready), self._loop)
        atexit.register(self.close)
        try:
            self.tools: list[McpToolInfo] = ready.result(connect_timeout_s)
        except BaseException as e:
            self.close()
            if isinstance(server, StdioServer) and isinstance(leaf(e), FileNotFoundError | PermissionError):
                raise ValueError(f"StdioServer.command={server.command!r}: cannot be run "
                                 f"({describe(e)})") from None
            timed_out = isinstance(e, concurrent.futures.TimeoutError)
            why = f"within {connect_timeout_s} s (timed out)" if timed_out else f"({describe(e)})"
            raise InfrastructureError(f"MCP server {server.label!r}: could not connect {why}") from e

    # -- the loop thread ----------------------------------------------------------------------
    async def _own(self, ready: concurrent.futures.Future) -> None:
        """Owner task: enters the transport and ``ClientSession`` and holds them until stop."""
        import anyio
        from mcp import ClientSession

        self._owner_task = asyncio.current_task()
        self._stop, self._dead = asyncio.Event(), asyncio.Event()
        try:
            async with contextlib.AsyncExitStack() as stack:
                read, write, self._stream = await stack.enter_async_context(
                    _transport(self.server, self.max_result_bytes))
                tg = await stack.enter_async_context(anyio.create_task_group())
                stack.callback(tg.cancel_scope.cancel)  # runs before the task group's exit
                send, watched = anyio.create_memory_object_stream(0)
                stack.push_async_callback(watched.aclose)
                stack.push_async_callback(send.aclose)
                tg.start_soon(self._watch, read, send)
                session = await stack.enter_async_context(ClientSession(watched, write))
                await session.initialize()
                tools = await _list_tools(session)
                self._session = session
                if not ready.done():
                    ready.set_result(tools)
                await self._stop.wait()
        except BaseException as e:  # reported to callers, then the task ends
            self._fail(f"session failed ({describe(e)})")
            if not ready.done():
                ready.set_exception(e if isinstance(e, Exception) else RuntimeError(repr(e)))
        finally:
            self._fail("session closed")
            self._dead.set()  # wakes the calls in flight (their replies can no longer arrive)
            self._owner_done.set()

    async def _watch(self, read: Any, send: Any) -> None:
        """Forward the transport's messages to the session; notice the server going away."""
        from mcp.shared.message import SessionMessage

        try:
            async with send:
                async for msg in read:
                    if isinstance(msg, Exception) and not isinstance(msg, SessionMessage) \
                            and _is_transport_failure(msg):
                        self._fail(f"transport failed ({type(msg).__name__}: {msg})")
                        break
                    await send.send(msg)
                else:
                    self._fail("the server closed the connection (exited?)")
        finally:
            if self._stop is not None:
                self._stop.set()

    def _fail(self, why: str) -> None:
        if self._failure is None:
            self._failure = why
            log.debug("MCP server %s: %s", self.server.label, why)

    async def _call(self, name: str, arguments: dict[str, Any], timeout_s: float) -> McpResult:
        import anyio

        if self._failure is not None:
            raise InfrastructureError(f"MCP server {self.server.label!r}: {self._failure}")
        mcp_error = _mcp_error_type()
        call = asyncio.ensure_future(self._session.call_tool(name, arguments))
        dead = asyncio.ensure_future(self._dead.wait())
        try:
            done, _ = await asyncio.wait({call, dead}, timeout=timeout_s,
                                         return_when=asyncio.FIRST_COMPLETED)
        finally:
            dead.cancel()
            if not call.done():
                call.cancel()
        if call not in done:
            self._suspect = True
            why = (f"the connection was lost ({self._failure})" if dead in done
                   else f"did not answer within {timeout_s} s")
            raise InfrastructureError(f"MCP server {self.server.label!r}: tool {name!r}: {why}")
        try:
            result = call.result()
        except mcp_error as e:
            code = e.error.code
            if code == INVALID_PARAMS:
                return McpResult(f"Error: {e.error.message}", True)
            if code == RESULT_TOO_LARGE:
                self._suspect = True
                return McpResult(f"Error: tool {name!r}: {e.error.message}", True)
            raise InfrastructureError(f"MCP server {self.server.label!r}: tool {name!r} failed with "
                                      f"JSON-RPC error {code}: {e.error.message}"
                                      + (f" ({self._failure})" if self._failure else "")) from e
        except (anyio.ClosedResourceError, anyio.BrokenResourceError, anyio.EndOfStream, OSError) as e:
            raise InfrastructureError(f"MCP server {self.server.label!r}: connection lost during tool "
                                      f"{name!r} ({self._failure or type(e).__name__})") from e
        out = content_text(result)
        if len(out.text.encode("utf-8", "surrogatepass")) > self.max_result_bytes:  # HTTP: checked on arrival
            return McpResult(f"Error: tool {name!r}: the tool's result is larger than the cap of "
                             f"{self.max_result_bytes} bytes (max_result_bytes)", True)
        return out

    async def _check(self, timeout_s: float) -> None:
        if self._stream.discarding:
            self._fail(f"wedged: still writing a message over the cap of {self.max_result_bytes} bytes "
                       "(max_result_bytes)")
            return
        if not self._suspect:
            return
        try:
            await asyncio.wait_for(self._session.send_ping(), timeout_s)
        except Exception as e:
            self._fail(f"wedged: no answer to a ping within {timeout_s} s after a timed-out or oversized "
                       f"call ({type(e).__name__})")
            return
        self._suspect = False

    # -- public API ---------------------------------------------------------------------------
    @property
    def alive(self) -> bool:
        """Connected and not failed or closed."""
        return self._failure is None and not self._closed

    def check(self, timeout_s: float = PING_TIMEOUT_S) -> bool:
        """Whether the session is usable, after checking one that may be wedged; thread-safe.

        A session whose reader is inside a message over the cap (a server writing endlessly
        without a newline), or that does not answer a ``ping`` within ``timeout_s`` after a call
        timed out or was over the cap, is failed here (:attr:`alive` becomes False), so that
        :meth:`McpToolset.ensure_connected` reconnects it. A healthy session costs nothing
        (no ping unless a call timed out or was oversized since the last check).

        Returns:
            :attr:`alive` afterwards.
        """
        if not self.alive:
            return False
        if self._stream.discarding or self._suspect:
            try:
                asyncio.run_coroutine_threadsafe(self._check(timeout_s), self._loop).result(timeout_s + 5.0)
            except Exception as e:  # the loop itself does not answer
                self._fail(f"wedged: the session's loop did not answer a check ({type(e).__name__})")
        return self.alive

    def call(self, name: str, arguments: Mapping[str, Any], timeout_s: float = 30.0) -> McpResult:
        """Call tool ``name`` with ``arguments``, blocking for at most ``timeout_s`` seconds.

        Thread-safe; concurrent calls run concurrently on the server.

        Returns:
            :class:`McpResult` (``is_error=True`` for a tool error or rejected arguments).

        Raises:
            ValueError: ``arguments`` not a mapping, ``timeout_s`` not > 0.
            RuntimeError: called from the session's own loop thread.
            InfrastructureError: the session is closed or failed, the server died, or no
                answer came within ``timeout_s`` (the late answer is discarded; the session
                stays usable, and the next :meth:`check` pings it: one that does not answer is
                reconnected on the next ``reset``). A result over ``max_result_bytes`` is a
                tool error naming the cap, not an exception.
        """
        if not isinstance(arguments, Mapping):
            raise ValueError(f"McpSession.call({name!r}): arguments={arguments!r} must be a mapping")
        if not isinstance(timeout_s, int | float) or not timeout_s > 0:
            raise ValueError(f"McpSession.call({name!r}): timeout_s={timeout_s!r} must be a number > 0")
        if threading.current_thread() is self._thread:
            raise RuntimeError("McpSession.call() must not be called from the session's own loop thread")
        if self._closed or self._failure is not None:
            raise InfrastructureError(f"MCP server {self.server.label!r}: "
                                      f"{'session closed' if self._closed else self._failure}")
        try:
            fut = asyncio.run_coroutine_threadsafe(self._call(name, dict(arguments), float(timeout_s)),
                                                   self._loop)
        except RuntimeError as e:  # loop closed by a concurrent close()
            raise InfrastructureError(f"MCP server {self.server.label!r}: session closed") from e
        try:
            return fut.result(timeout_s + 5.0)
        except (concurrent.futures.TimeoutError, concurrent.futures.CancelledError) as e:
            fut.cancel()
            self._suspect = True
            raise InfrastructureError(f"MCP server {self.server.label!r}: tool {name!r} did not answer "
                                      f"within {timeout_s} s ({self._failure or 'loop unresponsive'})") from e

    def close(self, timeout_s: float = 10.0) -> None:
        """Disconnect and (stdio) stop the server process; idempotent, thread-safe.

        Waits up to ``timeout_s`` seconds for the transport's orderly shutdown (stdio: stdin
        closed, 2 s grace, then SIGTERM/SIGKILL of the process tree).
        """
        with self._lock:
            if self._closed:
                return
            self._closed = True
        atexit.unregister(self.close)
        if self._loop.is_closed():
            return

        def stop() -> None:
            if self._session is not None and self._stop is not None:
                self._stop.set()  # orderly: leave the session and transport contexts
            elif self._owner_task is not None:
                self._owner_task.cancel()  # still connecting: abandon (the transport still cleans up)

        self._loop.call_soon_threadsafe(stop)
        if not self._owner_done.wait(timeout_s) and self._owner_task is not None:
            log.warning("MCP server %s: orderly shutdown took over %s s; cancelling", self.server.label,
                        timeout_s)
            self._loop.call_soon_threadsafe(self._owner_task.cancel)
            self._owner_done.wait(5.0)
        with contextlib.suppress(BaseException):
            asyncio.run_coroutine_threadsafe(_cancel_other_tasks(), self._loop).result(5.0)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout_s)
        if not self._thread.is_alive():
            self._loop.close()

    def __enter__(self) -> McpSession:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


async def _cancel_other_tasks() -> None:
    """Cancel and await every task of the running loop but the caller (calls still in flight)."""
    tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


def leaf(exc: BaseException) -> BaseException:
    """``exc``, or the first leaf of an exception group (anyio task groups wrap a transport's
    error in one)."""
    while isinstance(getattr(exc, "exceptions", None), tuple | list) and exc.exceptions:
        exc = exc.exceptions[0]
    return exc


def describe(exc: BaseException) -> str:
    """``"Type: message"`` of :func:`leaf` of ``exc``."""
    exc = leaf(exc)
    return f"{type(exc).__name__}: {exc}"


def _is_transport_failure(exc: BaseException) -> bool:
    """True for exceptions a transport reports when the connection itself failed (HTTP
    connection refused/reset, HTTP status errors), as opposed to one unparsable message."""
    if isinstance(exc, OSError):
        return True
    names = {c.__name__ for c in type(exc).__mro__}
    return bool(names & {"TransportError", "HTTPStatusError", "HTTPError", "StreamableHTTPError"})
