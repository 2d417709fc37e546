"""The OpenAI chat-completions wire shapes the harness endpoint reads and writes.

* :func:`normalize_message` puts a request message in the form history matching compares
  (role, text content, tool calls as ``(name, arguments object)``, ``tool_call_id``, ``name``);
* :func:`assistant_message` turns the model's decoded text into the assistant message returned
  (``content`` + ``tool_calls`` parsed by the product's ``hermes`` / ``openai`` parsers,
  :mod:`environments.tool_formats`);
* :func:`completion` builds the response body; :func:`error_body` an OpenAI error body.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Mapping, Sequence
from typing import Any

from environments.tool_formats import call_format

#: A closed ``<tool_call>`` block (every block is closed when the hermes parser found no error).
_HERMES_BLOCK = re.compile(r"<tool_call>.*?</tool_call>", re.DOTALL)


class RequestError(ValueError):
    """A request the endpoint refuses (answered ``400`` with this message)."""


def _text(content: Any) -> str:
    """A message's content as text: a string, ``None`` (``""``) or a list of ``{"type": "text"}`` parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(str(p.get("text", "")) for p in content if isinstance(p, Mapping))
    raise RequestError("message content must be a string or a list of text parts, got "
                       f"{type(content).__name__}")


def _arguments(raw: Any) -> Any:
    """A tool call's arguments as a JSON value (a string is decoded; undecodable stays the string)."""
    if isinstance(raw, str):
        try:
            return json.loads(raw) if raw.strip() else {}
        except ValueError:
            return raw
    return raw


def normalize_message(m: Any) -> tuple:
    """The comparable form of one chat message (history matching).

    Returns:
        ``(role, content text, ((name, arguments JSON), ...), tool_call_id, name)``; tool-call ids
        are left out (an agent may renumber them without changing a sampled token).

    Raises:
        RequestError: ``m`` is not a message object with a ``role``.
    """
    if not isinstance(m, Mapping) or not isinstance(m.get("role"), str):
        raise RequestError(f"each message must be an object with a 'role', got {m!r:.80}")
    calls = []
    for c in m.get("tool_calls") or ():
        fn = c.get("function", c) if isinstance(c, Mapping) else {}
        calls.append((str(fn.get("name", "")), json.dumps(_arguments(fn.get("arguments")), sort_keys=True)))
    return (m["role"], _text(m.get("content")), tuple(calls), str(m.get("tool_call_id") or ""),
            str(m.get("name") or ""))


def template_message(m: Mapping[str, Any]) -> dict[str, Any]:
    """``m`` as a chat template reads it: text content, tool-call arguments as objects.

    Raises:
        RequestError: see :func:`normalize_message`.
    """
    out: dict[str, Any] = {"role": m["role"], "content": _text(m.get("content"))}
    for key in ("name", "tool_call_id"):
        if m.get(key):
            out[key] = m[key]
    if m.get("tool_calls"):
        out["tool_calls"] = [{"id": c.get("id", f"call_{i}"), "type": "function",
                              "function": {"name": c["function"]["name"],
                                           "arguments": _arguments(c["function"].get("arguments"))}}
                             for i, c in enumerate(m["tool_calls"])]
    return out


def assistant_message(text: str, tool_format: str, call_prefix: str) -> dict[str, Any]:
    """The assistant message of the model's decoded ``text``.

    Tool calls are read with the product's parser of ``tool_format`` (``hermes``: ``<tool_call>``
    blocks; ``openai``: a JSON object with ``tool_calls``). When every call parses, they become
    OpenAI ``tool_calls`` (ids ``<call_prefix>_<i>``, ``arguments`` a JSON string) and ``content`` is
    the text outside the calls (``hermes``; ``None`` when empty) or ``None`` (``openai``). A turn
    with a malformed call is returned as plain ``content`` (the agent sees what the model wrote).

    Args:
        text: the model's text (special tokens removed). tool_format: ``hermes`` | ``openai``.
        call_prefix: prefix of the tool-call ids, unique within the episode.
    """
    fmt = call_format(tool_format, "harness")
    calls = fmt.parse(text) if fmt is not None else []
    if not calls or any(c.error for c in calls):
        return {"role": "assistant", "content": text}
    content: str | None = None
    if tool_format == "hermes":
        content = _HERMES_BLOCK.sub("", text).strip() or None
    return {"role": "assistant", "content": content,
            "tool_calls": [{"id": f"{call_prefix}_{i}", "type": "function",
                            "function": {"name": c.name,
                                         "arguments": json.dumps(c.arguments, ensure_ascii=False)}}
                           for i, c in enumerate(calls)]}


def completion(message: Mapping[str, Any], finish: str, model: str, cid: str, prompt_tokens: int,
               completion_tokens: int) -> dict[str, Any]:
    """The ``chat.completion`` response body of one choice.

    Args:
        message: :func:`assistant_message`. finish: the engine's finish reason (``eos`` / ``stop`` /
            ``length``); reported as ``tool_calls`` when the message has calls, ``length`` as is,
            else ``stop``.
        model: echoed from the request. cid: the completion id. prompt_tokens / completion_tokens:
            token counts.
    """
    reason = "tool_calls" if message.get("tool_calls") else ("length" if finish == "length" else "stop")
    return {"id": cid, "object": "chat.completion", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "message": dict(message), "finish_reason": reason, "logprobs": None}],
            "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                      "total_tokens": prompt_tokens + completion_tokens}}


def error_body(message: str, kind: str) -> dict[str, Any]:
    """An OpenAI error body ``{"error": {"message", "type"}}``."""
    return {"error": {"message": message, "type": kind, "param": None, "code": None}}


def stop_strings(raw: Any) -> tuple[str, ...]:
    """The request's ``stop`` (a string, a list of them, or ``None``) as a tuple.

    Raises:
        RequestError: any other value.
    """
    if raw is None:
        return ()
    if isinstance(raw, str):
        return (raw,) if raw else ()
    if isinstance(raw, Sequence) and all(isinstance(s, str) for s in raw):
        return tuple(s for s in raw if s)
    raise RequestError(f"stop={raw!r}: must be a string or a list of strings")
