"""What an MCP connection is made of: server descriptions (:class:`StdioServer`,
:class:`HttpServer`, :func:`server_from_kwargs`), declared tools (:class:`McpToolInfo`) and call
results (:class:`McpResult`, :func:`content_text`); no I/O.

Field names that changed between ``mcp`` 1.x (camelCase) and 2.x (snake_case) are read under
both spellings (:func:`mcp_field`).
"""

from __future__ import annotations

import json
import shlex
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class StdioServer:
    """An MCP server spawned as a subprocess speaking JSON-RPC over its stdin/stdout.

    Attributes:
        command: executable (``"python"``, ``"npx"``, an absolute path).
        args: its arguments.
        env: extra environment variables, added to the ``mcp`` package's minimal default
            environment (``HOME``, ``PATH``, ``USER``, ...; the host's secrets are not passed).
        cwd: working directory of the server (``None``: ours).

    Raises:
        ValueError: empty ``command``, non-str ``args`` or ``env`` entries.
    """

    command: str
    args: tuple[str, ...] = ()
    env: Mapping[str, str] | None = None
    cwd: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.command, str) or not self.command:
            raise ValueError(f"StdioServer.command={self.command!r}: must be a non-empty str")
        if isinstance(self.args, str) or not all(isinstance(a, str) for a in self.args):
            raise ValueError(f"StdioServer.args={self.args!r}: must be a list of str")
        object.__setattr__(self, "args", tuple(self.args))
        if self.env is not None and not all(isinstance(k, str) and isinstance(v, str)
                                            for k, v in dict(self.env).items()):
            raise ValueError(f"StdioServer.env={self.env!r}: must map str to str")

    @property
    def label(self) -> str:
        """``command arg1 arg2`` (for messages)."""
        return " ".join((self.command, *self.args))


@dataclass(frozen=True)
class HttpServer:
    """An MCP server reachable over the streamable HTTP transport.

    Attributes:
        url: its endpoint, e.g. ``http://127.0.0.1:8000/mcp``.
        headers: extra HTTP headers (e.g. ``{"Authorization": "Bearer ..."}``).

    Raises:
        ValueError: ``url`` not ``http(s)://...``.
    """

    url: str
    headers: Mapping[str, str] | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.url, str) or not self.url.startswith(("http://", "https://")):
            raise ValueError(f"HttpServer.url={self.url!r}: must start with http:// or https://")

    @property
    def label(self) -> str:
        """The URL (for messages)."""
        return self.url


@dataclass(frozen=True)
class McpToolInfo:
    """A tool as the server declares it (``tools/list``).

    Attributes:
        name: tool name.
        description: its description ("" if none).
        parameters: its ``inputSchema`` (a JSON Schema object, as a plain dict).
    """

    name: str
    description: str
    parameters: dict[str, Any]


@dataclass(frozen=True)
class McpResult:
    """Outcome of one ``tools/call``.

    Attributes:
        text: the result's content as text (text items joined by newlines; images, audio and
            resources as short ``[...]`` placeholders; the structured content as JSON when
            there is no other content).
        is_error: the tool reported an error (shown to the policy, the episode goes on).
        structured: ``structuredContent`` (or ``None``).
    """

    text: str
    is_error: bool
    structured: Any = None


def mcp_field(obj: Any, snake: str, camel: str, default: Any = None) -> Any:
    """``obj.snake`` (mcp 2.x) or ``obj.camel`` (mcp 1.x)."""
    value = getattr(obj, snake, None)
    return getattr(obj, camel, default) if value is None else value


def content_text(result: Any) -> McpResult:
    """Convert an ``mcp.types.CallToolResult`` into an :class:`McpResult` (see its fields)."""
    parts: list[str] = []
    for item in getattr(result, "content", None) or []:
        kind = getattr(item, "type", "")
        if kind == "text":
            parts.append(item.text)
        elif kind in ("image", "audio"):
            parts.append(f"[{kind} {mcp_field(item, 'mime_type', 'mimeType', '')}]")
        elif kind == "resource":
            res = item.resource
            text = getattr(res, "text", None)
            parts.append(text if text is not None else f"[resource {res.uri}]")
        elif kind == "resource_link":
            parts.append(f"[resource {item.uri}]")
        else:
            parts.append(f"[{kind or type(item).__name__}]")
    structured = mcp_field(result, "structured_content", "structuredContent")
    if not parts and structured is not None:
        parts.append(json.dumps(structured, ensure_ascii=False))
    return McpResult("\n".join(parts), bool(mcp_field(result, "is_error", "isError", False)), structured)


def server_from_kwargs(command: str | Sequence[str] | None = None, url: str | None = None,
                       env: Mapping[str, str] | None = None, cwd: str | None = None,
                       headers: Mapping[str, str] | None = None) -> StdioServer | HttpServer:
    """Build a server description from config-style keyword arguments.

    Args:
        command: ``["python", "server.py", ...]`` for stdio (a str is split like a shell would,
            ``shlex.split``).
        url: streamable HTTP endpoint instead.
        env / cwd: stdio only; headers: HTTP only.

    Raises:
        ValueError: neither or both of ``command`` and ``url``; an empty ``command``.
    """
    if (command is None) == (url is None):
        raise ValueError(f"MCP server: give exactly one of command= (stdio) or url= (HTTP); "
                         f"got command={command!r}, url={url!r}")
    if url is not None:
        return HttpServer(url, headers)
    parts = shlex.split(command) if isinstance(command, str) else list(command)
    if not parts:
        raise ValueError(f"MCP server: command={command!r} must not be empty")
    return StdioServer(parts[0], tuple(parts[1:]), env, cwd)
