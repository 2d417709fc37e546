"""Native tool-call formats of tool environments: JSON schemas, ``hermes`` and ``openai`` calls.

A :class:`~environments.base.ToolEnv` reads tool calls in one of :data:`TOOL_FORMATS`
(``tool_format``):

* ``tags`` (default): each tool's own tags (ReTool ``<code>``, Search-R1 ``<search>``); not
  handled here (``Tool.find`` / ``Tool.render``).
* ``hermes`` (Qwen2.5 / Qwen3 chat templates, NousResearch Hermes function calling): the model
  writes one or more ``<tool_call>{"name": N, "arguments": {...}}</tool_call>`` blocks in its
  turn; all of them run, in order. The text reply is one ``<tool_response>\\n...\\n</tool_response>``
  block per call (the chat template's rendering of ``role: "tool"`` messages replaces it when the
  rollout uses a chat template).
* ``openai``: the model's whole turn (surrounding whitespace aside) is one JSON object in the
  OpenAI chat API's shapes — an assistant message ``{"tool_calls": [{"id": ..., "type":
  "function", "function": {"name": N, "arguments": "<JSON string>" or {...}}}, ...]}``, one
  ``{"type": "function", "function": {...}}`` entry, or a bare ``{"name": N, "arguments": ...}``
  (``"parameters"`` is read as ``"arguments"``, as Llama 3.x writes it). A turn that does not start
  with ``{`` is not a tool call (e.g. the final answer). The text reply is one JSON tool message
  ``{"role": "tool", "tool_call_id": ..., "name": N, "content": ...}`` per line.

A call that cannot be used (bad JSON, no name, arguments not an object; the environment adds
unknown tool names and arguments that do not fit the schema) is a :class:`ParsedCall` with an
``error``: the policy gets ``error: <why>`` as that call's response and the episode goes on.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

#: Tool-call formats of :class:`~environments.base.ToolEnv` (``tool_format``).
TOOL_FORMATS = ("tags", "hermes", "openai")
#: Tool names a :class:`ToolSchema` accepts (OpenAI's ``[a-zA-Z0-9_-]{1,64}``, plus ``.`` and up
#: to 128 characters, as MCP allows).
TOOL_NAME_PATTERN = re.compile(r"[A-Za-z0-9_.\-]{1,128}")


class ToolArgumentError(ValueError):
    """The arguments of a JSON tool call do not fit the tool's :class:`ToolSchema`.

    The message names the tool and the argument (``"python: missing required argument 'code'"``);
    :class:`ToolEnv` shows it to the policy as an error tool response (never a crash).
    """


@dataclass(frozen=True)
class ToolSchema:
    """What a tool declares to a model in the native tool-call formats (``hermes`` / ``openai``).

    The OpenAI function-calling schema (https://platform.openai.com/docs/guides/function-calling)
    that chat templates render for the model (``tools=[schema.to_openai(), ...]``), and that MCP
    servers publish as ``name`` / ``description`` / ``inputSchema``.

    Attributes:
        name: the tool's name, ``[A-Za-z0-9_.-]{1,128}``; a call names it.
        description: what the tool does (shown to the model).
        parameters: JSON Schema (draft 2020-12 or older, checked with ``jsonschema``) of the
            arguments object: ``{"type": "object", "properties": {...}, "required": [...]}``.

    Raises:
        ValueError: a bad name, a non-str description, or parameters that are not a valid JSON
            Schema of an object (the message names the tool and the field).
    """

    name: str
    description: str
    parameters: Mapping[str, Any] = field(
        default_factory=lambda: {"type": "object", "properties": {}})

    def __post_init__(self) -> None:
        from jsonschema import exceptions, validators

        if not isinstance(self.name, str) or not TOOL_NAME_PATTERN.fullmatch(self.name):
            raise ValueError(f"ToolSchema.name={self.name!r}: must match [A-Za-z0-9_.-]{{1,128}}")
        if not isinstance(self.description, str):
            raise ValueError(f"ToolSchema.description={self.description!r} (tool {self.name!r}): "
                             "must be a str")
        params = self.parameters
        if not isinstance(params, Mapping) or params.get("type") != "object":
            raise ValueError(f"ToolSchema.parameters={params!r} (tool {self.name!r}): must be a JSON Schema "
                             "mapping with \"type\": \"object\"")
        try:
            validators.validator_for(dict(params)).check_schema(dict(params))
        except exceptions.SchemaError as e:
            raise ValueError(f"ToolSchema.parameters={dict(params)!r} (tool {self.name!r}): not a valid JSON "
                             f"Schema: {e.message}") from None
        object.__setattr__(self, "parameters", json.loads(json.dumps(dict(params))))

    def to_openai(self) -> dict[str, Any]:
        """``{"type": "function", "function": {"name", "description", "parameters"}}`` (a new dict)."""
        return {"type": "function", "function": {"name": self.name, "description": self.description,
                                                 "parameters": json.loads(json.dumps(self.parameters))}}

    @classmethod
    def from_openai(cls, spec: Mapping[str, Any]) -> ToolSchema:
        """Inverse of :meth:`to_openai`; also takes the bare ``{"name", "description", "parameters"}``.

        Raises:
            ValueError: not such a mapping, or a bad field (see the class).
        """
        fn = spec.get("function", spec) if isinstance(spec, Mapping) else None
        if not isinstance(fn, Mapping) or "name" not in fn:
            raise ValueError(f"tool spec={spec!r}: expected {{'type': 'function', 'function': {{'name', "
                             "'description', 'parameters'}}")
        return cls(fn["name"], fn.get("description", ""),
                   fn.get("parameters", {"type": "object", "properties": {}}))

    def check_arguments(self, arguments: Any) -> dict[str, Any]:
        """``arguments`` (a call's parsed JSON) checked against :attr:`parameters`.

        Returns:
            The arguments as a new ``dict``.

        Raises:
            ToolArgumentError: not a JSON object, a required argument missing, or an argument
                of the wrong type / value (the first such error, naming the argument).
        """
        from jsonschema import exceptions, validators

        if not isinstance(arguments, Mapping):
            raise ToolArgumentError(f"{self.name}: arguments must be a JSON object, got "
                                    f"{type(arguments).__name__} {arguments!r:.80}")
        args = dict(arguments)
        try:
            error = exceptions.best_match(validators.validator_for(self.parameters)(
                self.parameters).iter_errors(args))
        except RecursionError:
            raise ToolArgumentError(f"{self.name}: arguments nested too deeply") from None
        if error is None:
            return args
        if error.validator == "required" and not error.absolute_path:
            missing = [k for k in error.validator_value if k not in args]
            raise ToolArgumentError(f"{self.name}: missing required argument {missing[0]!r}")
        where = ".".join(str(p) for p in error.absolute_path)
        raise ToolArgumentError(f"{self.name}: argument {where!r}: {error.message}" if where
                                else f"{self.name}: {error.message}")


@runtime_checkable
class SchemaTool(Protocol):
    """A tool callable with JSON arguments (the ``hermes`` / ``openai`` tool-call formats).

    Contract (stable; MCP tools implement it too):

    * ``schema``: the :class:`ToolSchema` the model is shown; ``schema.name == name``.
    * ``run_arguments(arguments)``: run one call. :class:`ToolEnv` first checks ``arguments``
      with ``schema.check_arguments``, so implementations get a ``dict`` that fits the schema.
      Returns the tool response's text content (no wrapping tags; the env truncates it to
      ``max_observation_chars`` and the format wraps it). Bad input the policy chose (code that
      fails, a query the service rejects) is a result, returned as text; a tool may raise
      :class:`ToolArgumentError` for a check the schema cannot express (shown to the policy as
      an error response). A failure of the tool's machinery raises
      :class:`~environments.errors.InfrastructureError` (never scored as a wrong answer).
    """

    name: str
    schema: ToolSchema

    def run_arguments(self, arguments: Mapping[str, Any]) -> str:
        """Run one call with checked JSON ``arguments``; the response content text."""


@dataclass(frozen=True)
class ParsedCall:
    """One tool call read from a model turn in a native format.

    Attributes:
        call_id: the call's id (the model's ``"id"`` in the ``openai`` format, else ``call_<i>``,
            ``i`` = position in the turn).
        name: the tool's name (``None`` when it could not be read).
        arguments: the JSON arguments object (``None`` on error).
        error: why the call cannot run (``None`` for a well-formed call).
    """

    call_id: str
    name: str | None
    arguments: dict[str, Any] | None
    error: str | None = None


@dataclass(frozen=True)
class ToolResponse:
    """The response to one call: a ``role: "tool"`` chat message.

    Attributes:
        call_id: :attr:`ParsedCall.call_id` of the call answered.
        name: the tool's name, or ``None`` (a call whose name could not be read).
        content: the response text (tool output, or ``"error: <why>"``).
        error: the call was malformed or rejected (nothing ran).
    """

    call_id: str
    name: str | None
    content: str
    error: bool = False

    def message(self) -> dict[str, str]:
        """``{"role": "tool", "tool_call_id", "name" (if known), "content"}`` (OpenAI's tool message)."""
        msg = {"role": "tool", "tool_call_id": self.call_id}
        if self.name is not None:
            msg["name"] = self.name
        msg["content"] = self.content
        return msg


def _call_from_json(obj: Any, call_id: str) -> ParsedCall:
    """A :class:`ParsedCall` from a decoded ``{"name": N, "arguments": ...}`` object."""
    if not isinstance(obj, dict):
        return ParsedCall(call_id, None, None, 'a tool call must be a JSON object {"name": ..., '
                          f'"arguments": {{...}}}}, got {type(obj).__name__}')
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        return ParsedCall(call_id, None, None, 'the tool call has no "name" string')
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
            why = _lone_surrogate(args)
        except (ValueError, RecursionError) as e:
            why = str(e)
        if why:
            return ParsedCall(call_id, name, None, f'"arguments" of {name!r} is a string that is not '
                              f"valid JSON: {why}")
    if not isinstance(args, dict):
        return ParsedCall(call_id, name, None, f'"arguments" of {name!r} must be a JSON object, got '
                          f"{type(args).__name__}")
    return ParsedCall(call_id, name, args)


def _loads(text: str) -> tuple[Any, str | None]:
    """``(json.loads(text), None)``, or ``(None, why)`` for text that is not JSON, is nested too
    deeply to parse, or holds a lone UTF-16 surrogate escape (``"\\ud800"``: valid JSON syntax but
    not Unicode text; a tool would fail to encode it — a sandbox raises, an MCP session breaks)."""
    try:
        obj = json.loads(text)
        lone = _lone_surrogate(obj)
    except (ValueError, RecursionError) as e:
        return None, f"{type(e).__name__}: {e}"
    return (None, lone) if lone else (obj, None)


def _lone_surrogate(obj: Any) -> str | None:
    """Why decoded JSON ``obj`` is not Unicode text (a string or key holding a lone UTF-16
    surrogate, which ``json.loads`` lets through from a ``\\ud800`` escape), or ``None``.

    Raises:
        RecursionError: ``obj`` nested too deeply to re-encode.
    """
    try:
        json.dumps(obj, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError as e:
        code = ord(e.object[e.start])
        return f"a string holds a lone surrogate escape \\u{code:04x} (not a Unicode character)"
    return None


@runtime_checkable
class CallFormat(Protocol):
    """How tool calls are written in a model turn and how their responses are shown as text."""

    name: str
    #: Strings that end a model turn right after a call (the rollout engine stops on them).
    stop_strings: tuple[str, ...]

    def parse(self, action: str) -> list[ParsedCall]:
        """The calls of one model turn, in order (``[]``: the turn has no tool call)."""

    def format_calls(self, calls: Sequence[tuple[str, Mapping[str, Any]]]) -> str:
        """The text a model writes to make ``calls`` (``(name, arguments)`` pairs); the inverse of
        :meth:`parse`."""

    def render(self, responses: Sequence[ToolResponse]) -> str:
        """Observation text of a turn's responses (without a chat template)."""


@dataclass(frozen=True)
class HermesFormat:
    """``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` → ``<tool_response>`` blocks.

    Every block of the turn is a call (run in order); an unclosed ``<tool_call>`` (no
    ``</tool_call>`` after it) is a malformed call. ``"arguments"`` may also be a JSON string
    of the object. Text reply: ``"\\n" + "\\n".join("<tool_response>\\n{content}\\n</tool_response>")
    + "\\n"``.
    """

    name: str = "hermes"
    stop_strings: tuple[str, ...] = ("</tool_call>",)
    _pattern: re.Pattern[str] = field(default=re.compile(r"<tool_call>(.*?)(</tool_call>|\Z)", re.DOTALL),
                                      repr=False)

    def parse(self, action: str) -> list[ParsedCall]:
        """All ``<tool_call>`` blocks of ``action`` (``[]`` when there are none). Never raises."""
        calls = []
        for i, m in enumerate(self._pattern.finditer(action)):
            cid = f"call_{i}"
            if not m.group(2):
                calls.append(ParsedCall(cid, None, None, "unclosed <tool_call> (no </tool_call> after it)"))
                continue
            obj, why = _loads(m.group(1).strip())
            calls.append(ParsedCall(cid, None, None, f"invalid JSON in <tool_call>: {why}") if why
                         else _call_from_json(obj, cid))
        return calls

    def format_calls(self, calls: Sequence[tuple[str, Mapping[str, Any]]]) -> str:
        """``<tool_call>\\n{"name": N, "arguments": {...}}\\n</tool_call>`` blocks joined by ``\\n``
        (as Qwen2.5's chat template renders an assistant message's ``tool_calls``)."""
        return "\n".join("<tool_call>\n" + json.dumps({"name": n, "arguments": dict(a)}, ensure_ascii=False)
                         + "\n</tool_call>" for n, a in calls)

    def render(self, responses: Sequence[ToolResponse]) -> str:
        """One ``<tool_response>`` block per response (see the class)."""
        return "\n" + "\n".join(f"<tool_response>\n{r.content}\n</tool_response>" for r in responses) + "\n"


@dataclass(frozen=True)
class OpenAIFormat:
    """The OpenAI chat API's JSON shapes as text: a turn that is one JSON object (see the module).

    Text reply: one JSON tool message per line, ``"\\n" + lines + "\\n"``, each
    ``{"role": "tool", "tool_call_id": ..., "name": ..., "content": ...}``
    (``json.dumps(..., ensure_ascii=False)``). No stop string: the model ends a call turn with
    its end-of-turn token.
    """

    name: str = "openai"
    stop_strings: tuple[str, ...] = ()

    def parse(self, action: str) -> list[ParsedCall]:
        """The calls of ``action`` if it is a JSON object (``[]`` when it does not start with
        ``{``, or is an assistant message with no ``tool_calls``). Never raises."""
        text = action.strip()
        if not text.startswith("{"):
            return []
        obj, why = _loads(text)
        if why:
            return [ParsedCall("call_0", None, None, f"invalid JSON tool call: {why}")]
        if "tool_calls" in obj:
            entries = obj["tool_calls"]
            if entries is None:
                return []
            if not isinstance(entries, list):
                return [ParsedCall("call_0", None, None, '"tool_calls" must be a list, got '
                                   f"{type(entries).__name__}")]
        else:
            entries = [obj]
        calls = []
        for i, entry in enumerate(entries):
            cid = entry.get("id") if isinstance(entry, dict) else None
            cid = cid if isinstance(cid, str) and cid else f"call_{i}"
            fn = entry.get("function", entry) if isinstance(entry, dict) else entry
            calls.append(_call_from_json(fn, cid))
        return calls

    def format_calls(self, calls: Sequence[tuple[str, Mapping[str, Any]]]) -> str:
        """The assistant message ``{"tool_calls": [{"id": "call_<i>", "type": "function",
        "function": {"name": N, "arguments": "<JSON string>"}}, ...]}`` (OpenAI's wire format)."""
        return json.dumps({"tool_calls": [
            {"id": f"call_{i}", "type": "function",
             "function": {"name": n, "arguments": json.dumps(dict(a), ensure_ascii=False)}}
            for i, (n, a) in enumerate(calls)]}, ensure_ascii=False)

    def render(self, responses: Sequence[ToolResponse]) -> str:
        """One JSON tool message per line (see the class)."""
        return "\n" + "\n".join(json.dumps(r.message(), ensure_ascii=False) for r in responses) + "\n"


_FORMATS: dict[str, CallFormat] = {"hermes": HermesFormat(), "openai": OpenAIFormat()}


def call_format(name: str, owner: str = "ToolEnv") -> CallFormat | None:
    """The :class:`CallFormat` of ``name`` (``None`` for ``tags``: each tool's own tags).

    Raises:
        ValueError: ``"<owner>.tool_format=<name>: must be one of tags | hermes | openai"``.
    """
    if name not in TOOL_FORMATS:
        raise ValueError(f"{owner}.tool_format={name!r}: must be one of {' | '.join(TOOL_FORMATS)}")
    return _FORMATS.get(name)
