"""``McpToolEnv``: a question-answering tool environment whose tools are an MCP server's.

Registered as env id ``mcp``::

    task:
      env: mcp
      env_kwargs:
        command: [python, my_server.py]   # stdio: spawned per environment; or url: http://.../mcp
        tool_format: hermes               # or openai (MCP tools are JSON-schema tools)
      train_data: [my_questions.jsonl]    # rows {"question": ..., "answer": ...}

The prompt is ``prompt_template.format(question=sample["question"])``; the model calls the
server's tools in the native format and ends with ``<answer>...</answer>``. Reward: 1.0 when the
last ``<answer>`` of the final turn equals ``str(sample["answer"])`` after stripping both and
collapsing runs of whitespace (exact, case-sensitive match), else 0.0.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..base import EnvLimits, ToolEnv, check_prompt_template, with_overrides
from .servers import HttpServer, StdioServer, server_from_kwargs
from .session import DEFAULT_MAX_RESULT_BYTES, McpSession
from .tools import McpToolset

PROMPT = ("Answer the question. You can call the tools you are given. When you know the answer, "
          "write it as <answer>...</answer>.\n\nQuestion: {question}\n")
_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


@dataclass(frozen=True)
class McpEnvConfig:
    """Settings of :class:`McpToolEnv` (validated).

    Attributes:
        command: the stdio server's command line (``[executable, *args]``, or one str split
            like a shell would), or ``None``.
        url: the streamable HTTP endpoint, or ``None`` (exactly one of ``command`` / ``url``,
            unless the env is given a ``server`` / ``toolset``).
        server_env / cwd: stdio server's extra environment variables and working directory.
        headers: HTTP headers (e.g. authorization) for ``url``.
        tools: only these tools of the server (``None``: all).
        tool_format: ``hermes`` | ``openai``.
        call_timeout_s: per-call timeout (seconds); a late answer is an infrastructure failure.
        connect_timeout_s: seconds allowed to start/connect to the server.
        max_result_bytes: cap on one tool result (bytes, default 4 MiB; a larger one is a tool
            error naming the cap, see docs/mcp.md).
        limits: :class:`EnvLimits`.
        prompt_template: ``str.format`` template with ``{question}``.
    """

    command: Sequence[str] | None = None
    url: str | None = None
    server_env: Mapping[str, str] | None = None
    cwd: str | None = None
    headers: Mapping[str, str] | None = None
    tools: Sequence[str] | None = None
    tool_format: str = "hermes"
    call_timeout_s: float = 30.0
    connect_timeout_s: float = 30.0
    max_result_bytes: int = DEFAULT_MAX_RESULT_BYTES
    limits: EnvLimits = field(default_factory=lambda: EnvLimits(max_turns=8, max_tool_calls=8))
    prompt_template: str = PROMPT

    def __post_init__(self) -> None:
        check_prompt_template("McpEnvConfig", self.prompt_template, "question")
        if self.tool_format not in ("hermes", "openai"):
            raise ValueError(f"McpEnvConfig.tool_format={self.tool_format!r}: must be hermes or openai "
                             "(MCP tools are JSON-schema tools; the tags format has none)")
        for name in ("call_timeout_s", "connect_timeout_s"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int | float) or not v > 0:
                raise ValueError(f"McpEnvConfig.{name}={v!r}: must be a number > 0 (seconds)")
        v = self.max_result_bytes
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"McpEnvConfig.max_result_bytes={v!r}: must be an int >= 1 (bytes)")
        if self.tools is not None:
            if isinstance(self.tools, str) or not all(isinstance(t, str) for t in self.tools):
                raise ValueError(f"McpEnvConfig.tools={self.tools!r}: must be a list of tool names")
            object.__setattr__(self, "tools", tuple(self.tools))

    def server(self) -> StdioServer | HttpServer:
        """The server these settings describe.

        Raises:
            ValueError: neither or both of ``command`` and ``url`` (see
                :func:`~environments.mcp_tool.server_from_kwargs`).
        """
        return server_from_kwargs(command=self.command, url=self.url, env=self.server_env,
                                  cwd=self.cwd, headers=self.headers)


class McpToolEnv(ToolEnv):
    """Question answering with an MCP server's tools (see the module docstring for reward).

    The env connects to the server in the constructor (for stdio: spawns it) and closes it in
    :meth:`close`, unless given a shared ``toolset`` / ``session``; :meth:`reset` reconnects
    (respawns) a server that died. A failed tool call's infrastructure (timeout, dead server)
    raises :class:`~environments.errors.InfrastructureError` from :meth:`step`. Keyword
    overrides are fields of :class:`McpEnvConfig`.

    Args:
        config: :class:`McpEnvConfig`.
        server: a :class:`StdioServer` / :class:`HttpServer` (instead of ``command`` / ``url``).
        toolset: a shared :class:`McpToolset` (not closed by this env; ``tools`` then ignored).
        session: a shared :class:`McpSession` (not closed by this env).
        samples: rows ``{"question", "answer"}`` to draw from on ``reset``.

    Raises:
        ValueError: bad settings (see :class:`McpEnvConfig`); no server given.
        InfrastructureError: the server could not be started or reached.
    """

    answer_stop_strings = ("</answer>",)

    def __init__(self, config: McpEnvConfig | None = None, server: StdioServer | HttpServer | None = None,
                 toolset: McpToolset | None = None, session: McpSession | None = None,
                 samples: Sequence[Mapping[str, Any]] | None = None, **overrides: Any) -> None:
        cfg = config or McpEnvConfig()
        if overrides:
            cfg = with_overrides(cfg, overrides)
        self.config = cfg
        if sum(x is not None for x in (server, toolset, session)) > 1:
            raise ValueError("McpToolEnv: give at most one of server=, toolset=, session=")
        self._owns_toolset = toolset is None
        if toolset is None:
            source = session or server or cfg.server()
            toolset = McpToolset(source, cfg.call_timeout_s, cfg.connect_timeout_s, cfg.tools,
                                 max_result_bytes=cfg.max_result_bytes)
        self.toolset = toolset
        try:
            super().__init__(toolset.tools(), cfg.limits, samples, invalid_action_reply=None,
                             tool_format=cfg.tool_format)
        except BaseException:
            self.close()
            raise

    def reset(self, *, seed: int | None = None,
              options: dict[str, Any] | None = None) -> tuple[str, dict[str, Any]]:
        """:meth:`ToolEnv.reset`, after reconnecting to the server if it has died.

        Raises:
            InfrastructureError: the server cannot be reached again (see
                :meth:`McpToolset.ensure_connected`).
            ValueError: see :meth:`ToolEnv.reset`.
        """
        self.toolset.ensure_connected()
        return super().reset(seed=seed, options=options)

    def build_prompt(self, sample: Mapping[str, Any]) -> str:
        """``prompt_template`` with the sample's ``question``.

        Raises:
            ValueError: the sample has no ``question``.
        """
        if "question" not in sample:
            raise ValueError(f"mcp sample {sample.get('id')!r} has no 'question' field")
        return self.config.prompt_template.format(question=sample["question"])

    def extract_answer(self, action: str) -> str | None:
        """Content of the last ``<answer>...</answer>`` in ``action`` (``None`` if none)."""
        found = _ANSWER.findall(action)
        return found[-1] if found else None

    def score(self, sample: Mapping[str, Any], response: str, answer: str | None,
              tool_calls: int) -> tuple[float, dict[str, float]]:
        """1.0 if ``answer`` equals ``sample["answer"]`` (whitespace-normalised), else 0.0.

        Raises:
            ValueError: the sample has no ``answer``.
        """
        if "answer" not in sample:
            raise ValueError(f"mcp sample {sample.get('id')!r} has no 'answer' field")
        correct = answer is not None and _norm(answer) == _norm(str(sample["answer"]))
        return float(correct), {"exact_match": float(correct), "tool_calls": float(tool_calls)}

    def close(self) -> None:
        """Close the env's own toolset (and so its server); shared ones are left open."""
        if self._owns_toolset and getattr(self, "toolset", None) is not None:
            self.toolset.close()


def _norm(text: str) -> str:
    return " ".join(text.split())
