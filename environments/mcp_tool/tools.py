"""An MCP server's tools as environment tools: :class:`McpToolset` and :class:`McpTool`.

Each tool the server lists (``tools/list``: ``name``, ``description``, ``inputSchema``) becomes
one :class:`McpTool`, a :class:`~environments.tool_formats.SchemaTool` whose
:class:`~environments.tool_formats.ToolSchema` is the server's declaration (``inputSchema`` →
``parameters``), usable by any :class:`~environments.base.ToolEnv` in the ``hermes`` or
``openai`` tool-call format. All tools of a toolset share one :class:`McpSession`.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from typing import Any

from ..errors import InfrastructureError
from ..tool_formats import ToolSchema
from .servers import HttpServer, McpResult, StdioServer
from .session import DEFAULT_MAX_RESULT_BYTES, McpSession


class McpTool:
    """One MCP tool of an :class:`McpToolset`, called through the toolset's current session.

    Implements the :class:`~environments.tool_formats.SchemaTool` contract: ``name``,
    ``schema`` and :meth:`run_arguments`.

    Args:
        toolset: the toolset the tool belongs to (its session may be replaced by
            :meth:`McpToolset.ensure_connected`).
        schema: the tool's :class:`ToolSchema` (as the server declares it).
        timeout_s: seconds one call may take.

    Raises:
        ValueError: ``timeout_s`` not a number > 0.
    """

    def __init__(self, toolset: McpToolset, schema: ToolSchema, timeout_s: float = 30.0) -> None:
        if isinstance(timeout_s, bool) or not isinstance(timeout_s, int | float) or not timeout_s > 0:
            raise ValueError(f"McpTool({schema.name!r}): timeout_s={timeout_s!r} must be a number > 0 (s)")
        self.toolset, self.schema, self.timeout_s = toolset, schema, float(timeout_s)
        self.name = schema.name

    def call(self, arguments: Mapping[str, Any]) -> McpResult:
        """Call the tool with ``arguments`` (not checked against the schema here).

        Raises:
            InfrastructureError: see :meth:`McpSession.call`.
        """
        return self.toolset.session.call(self.name, arguments, self.timeout_s)

    def run_arguments(self, arguments: Mapping[str, Any]) -> str:
        """Run one call with schema-checked ``arguments``; the tool response's text.

        A tool-level error (``isError``, or arguments the server rejects) is returned as text
        starting with ``error:`` — shown to the policy, the episode goes on.

        Raises:
            InfrastructureError: the server is gone, or no answer within ``timeout_s``.
        """
        result = self.call(arguments)
        if result.is_error and not result.text.lower().startswith("error"):
            return f"error: {result.text}"
        return result.text

    def __repr__(self) -> str:
        return f"McpTool({self.name!r}, server={self.toolset.session.server.label!r})"


class McpToolset:
    """The tools of one MCP server, sharing one session (one server process for stdio).

    Args:
        server: a :class:`StdioServer` / :class:`HttpServer` (connected here and closed by
            :meth:`close`), or an existing :class:`McpSession` (shared: not closed here).
        timeout_s: per-call timeout of every tool (seconds).
        connect_timeout_s: seconds allowed to start/connect to the server.
        include: only these tools, in this order (``None``: all the server lists, in its
            order).
        max_result_bytes: cap on one result (:class:`McpSession`; default 4 MiB).

    Raises:
        ValueError: a name in ``include`` the server does not have (the message lists the
            server's tools); a tool whose name or schema is not a valid :class:`ToolSchema`.
        InfrastructureError: the server could not be started or reached.
    """

    def __init__(self, server: StdioServer | HttpServer | McpSession, timeout_s: float = 30.0,
                 connect_timeout_s: float = 30.0, include: Sequence[str] | None = None,
                 max_result_bytes: int = DEFAULT_MAX_RESULT_BYTES) -> None:
        if isinstance(include, str):
            raise ValueError(f"McpToolset: include={include!r} must be a list of tool names")
        self._owns = not isinstance(server, McpSession)
        self._connect_timeout_s = connect_timeout_s
        self._lock = threading.Lock()
        self._closed = False
        self.session = McpSession(server, connect_timeout_s, max_result_bytes) if self._owns else server
        try:
            declared = {t.name: t for t in self.session.tools}
            names = list(declared) if include is None else list(include)
            unknown = [n for n in names if n not in declared]
            if unknown:
                raise ValueError(f"McpToolset: include={list(include or [])!r}: server "
                                 f"{self.session.server.label!r} has no tool(s) {unknown}; it has "
                                 f"{list(declared)}")
            self._tools = [McpTool(self, _schema(declared[n].name, declared[n].description,
                                                 declared[n].parameters), timeout_s)
                           for n in names]
        except BaseException:
            self.close()
            raise

    def ensure_connected(self) -> None:
        """Reconnect (stdio: respawn the server) if the session has failed or is wedged
        (:meth:`McpSession.check`); thread-safe.

        Environments call it on ``reset``, so one dead server costs the episodes in flight,
        not every later episode.

        Raises:
            InfrastructureError: the toolset was given a shared session that has failed, the
                server cannot be reached again, or its tools' schemas changed.
        """
        with self._lock:
            old = self.session
            if old.check():  # a wedged session (timed out, oversized result) fails here
                return
            if self._closed:
                raise InfrastructureError(f"MCP server {old.server.label!r}: the toolset is closed")
            if not self._owns:
                raise InfrastructureError(f"MCP server {old.server.label!r}: the shared session has "
                                          "failed; reconnect it where it was created")
            old.close()
            new = McpSession(old.server, self._connect_timeout_s, old.max_result_bytes)
            declared = {t.name: t for t in new.tools}
            changed = [t.name for t in self._tools if t.name not in declared or
                       _schema(declared[t.name].name, declared[t.name].description,
                               declared[t.name].parameters) != t.schema]
            if changed:
                new.close()
                raise InfrastructureError(f"MCP server {old.server.label!r}: after reconnecting, the "
                                          f"tools {changed} are gone or have different schemas")
            self.session = new

    def tools(self) -> list[McpTool]:
        """The tools (one :class:`McpTool` per MCP tool; a new list of the same objects)."""
        return list(self._tools)

    def schemas(self) -> list[ToolSchema]:
        """The tools' schemas, in :meth:`tools` order."""
        return [t.schema for t in self._tools]

    def close(self) -> None:
        """Close the session if this toolset opened it (idempotent); the tools then raise
        :class:`InfrastructureError`."""
        with self._lock:
            self._closed = True
            if self._owns:
                self.session.close()

    def __enter__(self) -> McpToolset:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _schema(name: str, description: str, parameters: Mapping[str, Any]) -> ToolSchema:
    """``ToolSchema`` of a declared MCP tool (an empty ``inputSchema`` becomes an empty object)."""
    params = dict(parameters) or {"type": "object", "properties": {}}
    try:
        return ToolSchema(name, description, params)
    except ValueError as e:
        raise ValueError(f"MCP tool {name!r} cannot be used as an environment tool: {e}") from None
