"""MCP servers' tools as environment tools (needs the ``mcp`` extra: ``pip install 'copc[mcp]'``).

``McpToolset(StdioServer("python", ("server.py",))).tools()`` → one :class:`McpTool` per MCP
tool (a ``SchemaTool``: ``name``, ``schema``, ``run_arguments``), for any ``ToolEnv`` in the
``hermes`` / ``openai`` tool-call format; see ``docs/mcp.md`` and
:class:`environments.mcp_tool.env.McpToolEnv`.
"""

from __future__ import annotations

from .servers import HttpServer, McpResult, McpToolInfo, StdioServer, server_from_kwargs
from .session import McpSession
from .tools import McpTool, McpToolset

__all__ = ["HttpServer", "McpResult", "McpSession", "McpTool", "McpToolInfo", "McpToolset", "StdioServer",
           "server_from_kwargs"]
