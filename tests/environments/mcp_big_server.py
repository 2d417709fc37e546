"""An MCP stdio server for the result-cap and wedge tests (FastMCP, real protocol).

Tools: ``add(a, b)``; ``big(n)`` (a text result of ``n`` bytes); ``endless()`` (writes the start
of its JSON-RPC response to stdout, then ``x`` forever, never a newline); ``block(seconds)`` (a
synchronous sleep that blocks the server's event loop: it answers nothing, not even a ping);
``slow(seconds)`` (an asynchronous sleep: the server stays responsive).
"""

from __future__ import annotations

import asyncio
import os
import threading
import time

try:  # mcp 1.x
    from mcp.server.fastmcp import Context
    from mcp.server.fastmcp import FastMCP as _Server
except ImportError:  # mcp 2.x
    from mcp.server.mcpserver import Context
    from mcp.server.mcpserver import MCPServer as _Server

server = _Server("big", log_level="WARNING")


@server.tool()
def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


@server.tool()
def big(n: int) -> str:
    """A text of n bytes."""
    return "x" * n


@server.tool()
async def endless(ctx: Context) -> str:
    """Write a response that never ends."""
    head = f'{{"jsonrpc":"2.0","id":{ctx.request_id},"result":{{"content":[{{"type":"text","text":"'.encode()

    def spew() -> None:
        os.write(1, head)
        block = b"x" * 65536
        while True:
            os.write(1, block)

    threading.Thread(target=spew, daemon=True).start()
    await asyncio.sleep(3600)
    return "never"


@server.tool()
def block(seconds: float) -> str:
    """Block the whole server for `seconds`."""
    time.sleep(seconds)
    return "unblocked"


@server.tool()
async def slow(seconds: float) -> str:
    """Sleep without blocking the server."""
    await asyncio.sleep(seconds)
    return "slept"


if __name__ == "__main__":
    server.run()
