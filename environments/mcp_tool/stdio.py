"""The MCP stdio transport with a cap on one message: :func:`capped_stdio_client`.

The ``mcp`` package's ``stdio_client`` (1.30) reads the server's stdout as text and splits it with
``(buffer + chunk).split("\\n")``: a message of ``n`` bytes costs ``O(n^2 / 64 KiB)`` copying,
and a server that writes without a newline grows the buffer without bound. This transport is
the same protocol (the same process start-up: the ``mcp`` package's default environment plus
``StdioServer.env``, a new session for the process group; the same shutdown: stdin closed, 2 s,
then SIGTERM / SIGKILL of the group), with a linear, capped reader (:class:`LineReader`):

* a line (one JSON-RPC message) of at most ``max_message_bytes`` is parsed as the ``mcp``
  client does;
* a longer one is never held: once it passes the cap its bytes are discarded up to its newline.
  The request it answers gets, at once, a JSON-RPC error ``RESULT_TOO_LARGE`` naming the cap
  (its id read from the message's start — ``{"jsonrpc": "2.0", "id": 7, ...`` as Python and
  most servers write it — or, failing that, from its end when it finally arrives);
  :attr:`StreamState.discarding` tells whether the reader is inside such a line (a server that
  writes endlessly without a newline stays there: its session is reconnected, see
  :meth:`~environments.mcp_tool.session.McpSession.check`).

POSIX only (the project's platform).
"""

from __future__ import annotations

import contextlib
import json
import logging
import re
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

log = logging.getLogger(__name__)

#: JSON-RPC error code of a result over the cap (implementation-defined server-error range).
RESULT_TOO_LARGE = -32099
#: Bytes of an oversized message's start and end kept to find its id.
_ID_WINDOW = 1024
_ID = r'"id"\s*:\s*(-?\d+|"(?:[^"\\]|\\.){0,200}")'
_HEAD_ID = re.compile(rb'^\s*\{\s*(?:"jsonrpc"\s*:\s*"2\.0"\s*,\s*)?' + _ID.encode())
_TAIL_ID = re.compile(rb",\s*" + _ID.encode() + rb"\s*\}\s*$")


def message_id(head: bytes, tail: bytes) -> int | str | None:
    """The JSON-RPC id of a message from its first and last bytes (``None``: not found).

    Looked for as the first member (``{"jsonrpc": "2.0", "id": 7, ...`` or ``{"id": 7, ...``)
    or the last one (``..., "id": 7}``), never inside the result.
    """
    m = _HEAD_ID.match(head) or _TAIL_ID.search(tail)
    if m is None:
        return None
    try:
        value = json.loads(m.group(1))
    except ValueError:
        return None
    return value if isinstance(value, int | str) else None


@dataclass
class StreamState:
    """What the reader is doing, for the session's health check.

    Attributes:
        discarding: inside a message longer than the cap (its bytes are being thrown away).
        oversized: messages over the cap so far.
    """

    discarding: bool = False
    oversized: int = 0


class LineReader:
    """Splits a byte stream into lines of at most ``cap`` bytes, in linear time.

    :meth:`feed` returns events: ``("line", bytes)`` for a complete line (newline removed),
    ``("over", head)`` when a line passes the cap (``head``: its first bytes), ``("end", tail)``
    when such a line ends (``tail``: its last bytes). Memory: at most ``cap`` bytes plus the
    windows.

    Args:
        cap: most bytes of one line (>= 1). state: updated (``discarding``, ``oversized``).
    """

    def __init__(self, cap: int, state: StreamState) -> None:
        if isinstance(cap, bool) or not isinstance(cap, int) or cap < 1:
            raise ValueError(f"LineReader: cap={cap!r} must be an int >= 1 (bytes)")
        self.cap, self.state = cap, state
        self._parts: list[bytes] = []
        self._size = 0
        self._tail = b""

    def feed(self, chunk: bytes) -> list[tuple[str, bytes]]:
        """Consume ``chunk``; the events it completes (see the class)."""
        events: list[tuple[str, bytes]] = []
        start = 0
        while True:
            nl = chunk.find(b"\n", start)
            piece = chunk[start:nl] if nl >= 0 else chunk[start:]
            if self.state.discarding:
                self._tail = (self._tail + piece[-_ID_WINDOW:])[-_ID_WINDOW:]
            elif self._size + len(piece) > self.cap:
                head = (b"".join(self._parts[:4]) + piece[:_ID_WINDOW])[:_ID_WINDOW]
                self._parts, self._size, self._tail = [], 0, piece[-_ID_WINDOW:]
                self.state.discarding = True
                self.state.oversized += 1
                events.append(("over", head))
            else:
                self._parts.append(piece)
                self._size += len(piece)
            if nl < 0:
                return events
            if self.state.discarding:
                events.append(("end", self._tail))
                self.state.discarding, self._tail = False, b""
            else:
                events.append(("line", b"".join(self._parts)))
                self._parts, self._size = [], 0
            start = nl + 1


def too_large_message(request_id: int | str, cap: int) -> Any:
    """The JSON-RPC error answering ``request_id`` whose result was over ``cap`` bytes."""
    from mcp import types
    from mcp.shared.message import SessionMessage

    error = types.ErrorData(code=RESULT_TOO_LARGE,
                            message=f"the tool's result is larger than the cap of {cap} bytes "
                                    "(max_result_bytes); it was not read")
    return SessionMessage(types.JSONRPCMessage(types.JSONRPCError(jsonrpc="2.0", id=request_id, error=error)))


@contextlib.asynccontextmanager
async def capped_stdio_client(server: Any, max_message_bytes: int
                              ) -> AsyncIterator[tuple[Any, Any, StreamState]]:
    """Spawn ``server`` (a :class:`~environments.mcp_tool.servers.StdioServer`) and yield
    ``(read_stream, write_stream, state)`` as ``mcp.client.stdio.stdio_client`` does, with the
    capped reader of the module docstring.

    Raises:
        OSError: the command cannot be started (``FileNotFoundError``, ``PermissionError``).
    """
    import anyio
    from mcp import types
    from mcp.client.stdio import PROCESS_TERMINATION_TIMEOUT, get_default_environment
    from mcp.os.posix.utilities import terminate_posix_process_tree
    from mcp.shared.message import SessionMessage

    state = StreamState()
    reader = LineReader(max_message_bytes, state)
    read_writer, read_stream = anyio.create_memory_object_stream(0)
    write_stream, write_reader = anyio.create_memory_object_stream(0)
    env = {**get_default_environment(), **dict(server.env or {})}
    try:
        process = await anyio.open_process([server.command, *server.args], env=env, stderr=sys.stderr,
                                           cwd=server.cwd, start_new_session=True)
    except OSError:
        for s in (read_stream, write_stream, read_writer, write_reader):
            await s.aclose()
        raise

    async def stdout_reader() -> None:
        answered: set[int | str] = set()
        head = b""
        with contextlib.suppress(anyio.ClosedResourceError):
            async with read_writer:
                async for chunk in process.stdout:
                    for kind, data in reader.feed(chunk):
                        if kind == "line":
                            if not data.strip():
                                continue
                            try:
                                msg = types.JSONRPCMessage.model_validate_json(data)
                            except Exception as exc:  # as the mcp client: reported, not fatal
                                await read_writer.send(exc)
                                continue
                            await read_writer.send(SessionMessage(msg))
                            continue
                        if kind == "over":
                            head = data
                            rid = message_id(head, b"")
                        else:
                            rid = message_id(head, data)
                        log.warning("MCP server %s: a message over %d bytes was discarded", server.label,
                                    max_message_bytes)
                        if rid is not None and rid not in answered:
                            answered.add(rid)
                            await read_writer.send(too_large_message(rid, max_message_bytes))
                        if kind == "end":
                            answered.clear()

    async def stdin_writer() -> None:
        with contextlib.suppress(anyio.ClosedResourceError):
            async with write_reader:
                async for message in write_reader:
                    data = message.message.model_dump_json(by_alias=True, exclude_none=True)
                    await process.stdin.send((data + "\n").encode("utf-8"))

    async with anyio.create_task_group() as tg, process:
        tg.start_soon(stdout_reader)
        tg.start_soon(stdin_writer)
        try:
            yield read_stream, write_stream, state
        finally:
            with contextlib.suppress(Exception):
                await process.stdin.aclose()
            try:
                with anyio.fail_after(PROCESS_TERMINATION_TIMEOUT):
                    await process.wait()
            except TimeoutError:
                await terminate_posix_process_tree(process)
            except ProcessLookupError:
                pass
            for s in (read_stream, write_stream, read_writer, write_reader):
                await s.aclose()
            tg.cancel_scope.cancel()


__all__ = ["RESULT_TOO_LARGE", "LineReader", "StreamState", "capped_stdio_client", "message_id",
           "too_large_message"]
