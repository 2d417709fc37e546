"""A tiny MCP server for the MCP-tool tests, built with the ``mcp`` package's FastMCP API.

Tools: ``add(a, b)`` (integers), ``slow(seconds)`` (sleeps, then returns ``"slept"``),
``fail(message)`` (raises, so the result has ``isError``), ``pid()`` (the server's process id).

Run: ``python mcp_calc_server.py`` (stdio) or ``python mcp_calc_server.py --http PORT``
(streamable HTTP on 127.0.0.1:PORT, endpoint ``/mcp``).
"""

from __future__ import annotations

import argparse
import asyncio
import os

try:  # mcp 1.x
    from mcp.server.fastmcp import FastMCP as _Server
except ImportError:  # mcp 2.x renamed it
    from mcp.server.mcpserver import MCPServer as _Server

server = _Server("calc", log_level="WARNING")


@server.tool()
def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


@server.tool()
async def slow(seconds: float) -> str:
    """Sleep for `seconds` seconds, then answer "slept"."""
    await asyncio.sleep(seconds)
    return "slept"


@server.tool()
def fail(message: str) -> str:
    """Always raise an error carrying `message`."""
    raise ValueError(message)


@server.tool()
def pid() -> int:
    """The server's process id."""
    return os.getpid()


def main() -> None:
    """Serve over stdio, or over streamable HTTP with ``--http PORT``."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--http", type=int, default=None, help="serve streamable HTTP on 127.0.0.1:PORT")
    args = ap.parse_args()
    if args.http is None:
        server.run()
        return
    if hasattr(server, "settings"):  # mcp 1.x: transport settings live on the server
        server.settings.host, server.settings.port = "127.0.0.1", args.http
        server.settings.log_level = "WARNING"
        server.run(transport="streamable-http")
    else:
        server.run(transport="streamable-http", host="127.0.0.1", port=args.http)


if __name__ == "__main__":
    main()
