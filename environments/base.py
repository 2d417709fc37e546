"""Multi-turn text tool environments on top of ``gymnasium.Env``.

An episode: ``reset`` returns the prompt text; each ``step(action)`` takes the model's text for
one turn. If the action contains a tool call (the earliest one, by position, over all tools),
the tool runs and its rendered result is the next observation; if it contains a final answer
and no tool call, the episode terminates and is scored; otherwise the action is invalid.
Rewards are computed from the concatenated *actions* only (never the prompt or tool output).

Tool calls are read in the env's ``tool_format`` (:data:`TOOL_FORMATS`): ``tags`` (each tool's
own tags) or a native JSON format, ``hermes`` / ``openai`` (:mod:`environments.tool_formats`),
where tools declare a :class:`ToolSchema` and run from JSON arguments (:class:`SchemaTool`).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import gymnasium
from gymnasium import spaces

from .tool_formats import (
    TOOL_FORMATS,
    CallFormat,
    ParsedCall,
    SchemaTool,
    ToolArgumentError,
    ToolResponse,
    ToolSchema,
    call_format,
)

__all__ = ["MAX_ERROR_CHARS", "TOOL_FORMATS", "EnvLimits", "RegexTool", "SchemaTool", "TextSpace", "Tool",
           "ToolArgumentError", "ToolCall", "ToolEnv", "ToolSchema", "check_prompt_template", "clip",
           "truncate_observation", "with_overrides"]

TRUNCATION_MARKER = "\n...[truncated {n} characters]...\n"
#: Longest explanation of a malformed native tool call shown to the policy (characters; the rest
#: of a quoted argument value is cut), and longest tool name echoed in its response.
MAX_ERROR_CHARS = 512
MAX_ERROR_NAME_CHARS = 128


class TextSpace(spaces.Text):
    """``gymnasium.spaces.Text`` that accepts any Unicode string up to ``max_length`` chars.

    Gymnasium's ``Text`` only accepts characters of its (sampling) charset; model text and
    tool output are arbitrary Unicode, so ``contains`` checks type and length only. Samples
    are drawn from printable ASCII.
    """

    def __init__(self, max_length: int, seed: int | None = None) -> None:
        charset = "".join(chr(c) for c in range(32, 127)) + "\n"
        super().__init__(max_length=max_length, min_length=0, charset=charset, seed=seed)

    def contains(self, x: Any) -> bool:
        """True for a ``str`` of at most ``max_length`` characters."""
        return isinstance(x, str) and len(x) <= self.max_length


@dataclass(frozen=True)
class ToolCall:
    """One tool call found in an action: tool name, payload, and its ``[start, end)`` span."""

    tool: str
    payload: str
    start: int
    end: int


@runtime_checkable
class Tool(Protocol):
    """A tool: how a call is found in text, how it runs, how its result is rendered."""

    name: str

    def find(self, text: str) -> ToolCall | None:
        """Return the first well-formed call in ``text`` or ``None``."""

    def run(self, payload: str) -> Any:
        """Execute the call; must not raise for bad payloads (return an error result)."""

    def render(self, result: Any) -> str:
        """Observation text for ``result`` (e.g. ``<interpreter>...</interpreter>``)."""


class RegexTool:
    """Base for tools whose calls are ``open_tag ... close_tag`` spans matched by a regex.

    Subclasses set ``name`` and ``pattern`` (group 1 = payload) and implement ``run`` and
    ``render``. To be usable in the native formats too (a :class:`SchemaTool`), they also set
    ``schema`` and ``payload_argument`` (the schema property holding the payload) and
    override :meth:`content` if ``str(result)`` is not the right response text.
    """

    name = "tool"
    pattern: re.Pattern[str] = re.compile(r"<tool>(.*?)</tool>", re.DOTALL)
    #: JSON schema of the tool (``None``: tags format only).
    schema: ToolSchema | None = None
    #: The schema property whose value :meth:`run_arguments` passes to :meth:`run` as payload.
    payload_argument: str = "input"

    def content(self, result: Any) -> str:
        """Response text of ``result`` in the native formats (no tags); default ``str(result)``."""
        return str(result)

    def run_arguments(self, arguments: Mapping[str, Any]) -> str:
        """Run a JSON call: ``content(run(str(arguments[payload_argument])))``.

        Raises:
            TypeError: the tool has no ``schema``.
            ToolArgumentError: ``arguments`` do not fit the schema.
        """
        if self.schema is None:
            raise TypeError(f"tool {self.name!r} has no schema; it works in the tags format only")
        args = self.schema.check_arguments(arguments)
        if self.payload_argument not in args:
            raise ToolArgumentError(f"{self.name}: missing required argument {self.payload_argument!r}")
        return self.content(self.run(str(args[self.payload_argument])))

    def find(self, text: str) -> ToolCall | None:
        """First match of ``pattern`` in ``text``."""
        m = self.pattern.search(text)
        if m is None:
            return None
        return ToolCall(self.name, m.group(1), m.start(), m.end())


@dataclass(frozen=True)
class EnvLimits:
    """Episode limits.

    Attributes:
        max_turns: most actions (model turns) per episode; reaching it truncates.
        max_tool_calls: most tool executions per episode; more calls get an error reply.
        max_observation_chars: longer tool observations are cut in the middle with a visible
            ``...[truncated N characters]...`` marker.
        max_action_chars: ``action_space`` length bound (characters).
    """

    max_turns: int = 8
    max_tool_calls: int = 8
    max_observation_chars: int = 4096
    max_action_chars: int = 65536

    def __post_init__(self) -> None:
        for name in ("max_turns", "max_tool_calls", "max_observation_chars", "max_action_chars"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"EnvLimits.{name}={v!r}: must be an int >= 1")


def with_overrides(config: Any, overrides: Mapping[str, Any]) -> Any:
    """``dataclasses.replace(config, **overrides)`` where nested dataclass fields may be mappings.

    YAML configs give nested settings (``limits``, ``reward``, ``sandbox``) as plain mappings;
    each is built into the field's dataclass, starting from the field's current value, so
    ``{"limits": {"max_turns": 2}}`` keeps the other limits.

    Raises:
        ValueError: a nested field got something other than a mapping or its dataclass
            (``"MathToolConfig.limits=5: must be a mapping of EnvLimits fields"``).
        TypeError: an unknown key (``"... got an unexpected keyword argument 'x'"``).
    """
    import dataclasses

    kwargs = dict(overrides)
    for f in dataclasses.fields(config):
        current = getattr(config, f.name)
        if f.name not in kwargs or not dataclasses.is_dataclass(current):
            continue
        value = kwargs[f.name]
        if isinstance(value, Mapping):
            kwargs[f.name] = dataclasses.replace(current, **value)
        elif not isinstance(value, type(current)):
            raise ValueError(f"{type(config).__name__}.{f.name}={value!r}: must be a mapping of "
                             f"{type(current).__name__} fields")
    return dataclasses.replace(config, **kwargs)


def check_prompt_template(owner: str, template: str, field_name: str) -> None:
    """Check that ``template`` is a ``str.format`` template whose only field is ``{field_name}``.

    Raises:
        ValueError: ``"<owner>.prompt_template=...: ..."`` when the field is missing or the
            template has other fields / unbalanced braces.
    """
    if "{" + field_name + "}" not in template:
        raise ValueError(f"{owner}.prompt_template must contain '{{{field_name}}}'")
    try:
        template.format(**{field_name: ""})
    except (KeyError, IndexError, ValueError) as e:
        raise ValueError(f"{owner}.prompt_template={template!r}: not a str.format template with only "
                         f"{{{field_name}}} ({type(e).__name__}: {e}); "
                         "write literal braces as {{ }}") from None


def clip(text: str, max_chars: int) -> str:
    """``text`` if at most ``max_chars`` characters, else its first ``max_chars`` characters and
    ``"...[N more characters]"``."""
    if len(text) <= max_chars:
        return text
    return f"{text[:max_chars]}...[{len(text) - max_chars} more characters]"


def truncate_observation(text: str, max_chars: int) -> str:
    """Cut ``text`` to about ``max_chars`` characters keeping head and tail, with a marker."""
    if len(text) <= max_chars:
        return text
    keep = max(max_chars - len(TRUNCATION_MARKER.format(n=len(text))), 2)
    head, tail = keep // 2, keep - keep // 2
    return text[:head] + TRUNCATION_MARKER.format(n=len(text) - head - tail) + text[-tail:]


@dataclass
class _Episode:
    sample: Mapping[str, Any]
    prompt: str
    actions: list[str] = field(default_factory=list)
    tool_calls: int = 0
    done: bool = False


class ToolEnv(gymnasium.Env):
    """Base class of multi-turn text tool environments (observation/action = text).

    Subclasses implement :meth:`build_prompt`, :meth:`extract_answer` and :meth:`score`, and
    pass their tools. ``info`` of ``reset``/``step`` has: ``turn`` (actions taken so far),
    ``tool_calls`` (executed so far), ``tool`` (name of the tool run this step or None),
    ``invalid`` (action had neither a tool call nor a final answer), ``final_answer``
    (parsed, or None), ``reward_components`` (dict, on the last step), ``sample_id``.

    In the native formats (``tool_format`` ``hermes`` / ``openai``) every call of a turn runs,
    in order (each counts towards ``max_tool_calls``; each response is cut to
    ``max_observation_chars``); a malformed call (bad JSON, unknown tool, arguments that do not
    fit the schema) gets an ``error: ...`` response and the episode goes on. ``info`` then also
    has ``tool_error`` (a call of this step was malformed; it also sets
    ``invalid``, as does a call over ``max_tool_calls``) and, on a step that continues the
    episode, ``observation_messages``: the chat messages the observation stands for
    (``role: "tool"`` responses; ``role: "user"`` for the invalid-action reply), which a rollout
    with a chat template renders instead of the text. ``reset``'s ``info`` has ``tools``: the
    OpenAI function schemas (``ToolSchema.to_openai``) to give the chat template.

    Args:
        tools: tools recognised in actions (:class:`Tool` for ``tags``; :class:`SchemaTool`
            with a ``schema`` for the native formats).
        limits: :class:`EnvLimits`.
        samples: data rows to draw from on ``reset`` without ``options["sample"]``.
        invalid_action_reply: observation for an invalid action; ``None`` ends the episode
            (scored as is) instead.
        tool_format: ``tags`` | ``hermes`` | ``openai``.

    Raises:
        ValueError: unknown ``tool_format``; a native format with a tool that has no schema, or
            two tools with the same schema name.
    """

    metadata: dict[str, Any] = {"render_modes": []}  # noqa: RUF012 - gymnasium convention
    #: Strings that end a model turn (a tool call's or answer's closing tag); a rollout
    #: engine stops generating right after the token that completes one (EOS also ends a turn).
    stop_strings: tuple[str, ...] = ()
    #: The answer's stop strings, kept in the native formats (where the tools' tags are replaced
    #: by the format's, e.g. ``</tool_call>``).
    answer_stop_strings: tuple[str, ...] = ()

    def __init__(self, tools: Sequence[Tool | SchemaTool], limits: EnvLimits | None = None,
                 samples: Sequence[Mapping[str, Any]] | None = None,
                 invalid_action_reply: str | None = None, tool_format: str = "tags") -> None:
        self.tool_format = tool_format
        self.call_format: CallFormat | None = call_format(tool_format, type(self).__name__)
        self.tools = list(tools)
        self.schema_tools: dict[str, SchemaTool] = {}
        if self.call_format is not None:
            for t in self.tools:
                schema = getattr(t, "schema", None)
                if not isinstance(schema, ToolSchema) or not callable(getattr(t, "run_arguments", None)):
                    raise ValueError(f"{type(self).__name__}.tool_format={tool_format!r}: tool "
                                     f"{getattr(t, 'name', t)!r} has no ToolSchema `schema` and "
                                     "`run_arguments`; the native formats need both")
                if schema.name in self.schema_tools:
                    raise ValueError(f"{type(self).__name__}.tool_format={tool_format!r}: two tools "
                                     f"named {schema.name!r}")
                self.schema_tools[schema.name] = t
            self.stop_strings = tuple(dict.fromkeys((*self.call_format.stop_strings,
                                                     *self.answer_stop_strings)))
        self.limits = limits or EnvLimits()
        self.samples = list(samples) if samples is not None else None
        self.invalid_action_reply = invalid_action_reply
        self.observation_space = TextSpace(max(self.limits.max_observation_chars, 1 << 20))
        self.action_space = TextSpace(self.limits.max_action_chars)
        self._ep: _Episode | None = None

    # -- subclass hooks -------------------------------------------------------------------
    def build_prompt(self, sample: Mapping[str, Any]) -> str:
        """Prompt text for ``sample``."""
        raise NotImplementedError

    def extract_answer(self, action: str) -> str | None:
        """Final answer in one action, or ``None`` if it has none."""
        raise NotImplementedError

    def score(self, sample: Mapping[str, Any], response: str, answer: str | None,
              tool_calls: int) -> tuple[float, dict[str, float]]:
        """(reward, components) for the model's concatenated actions ``response``."""
        raise NotImplementedError

    @property
    def tool_schemas(self) -> list[ToolSchema]:
        """Schemas of the tools (native formats; ``[]`` in ``tags``)."""
        return [t.schema for t in self.schema_tools.values()]

    # -- gymnasium API ------------------------------------------------------------------------
    def reset(self, *, seed: int | None = None,
              options: dict[str, Any] | None = None) -> tuple[str, dict[str, Any]]:
        """Start an episode on ``options["sample"]`` or a seeded random row of ``samples``.

        Raises:
            ValueError: neither ``options["sample"]`` nor ``samples`` is available.
        """
        super().reset(seed=seed)
        sample = (options or {}).get("sample")
        if sample is None:
            if not self.samples:
                raise ValueError(
                    f"{type(self).__name__}.reset: pass options={{'sample': {{...}}}} or "
                    "construct the env with samples")
            sample = self.samples[int(self.np_random.integers(len(self.samples)))]
        if not isinstance(sample, Mapping):
            raise ValueError(f"options['sample'] must be a mapping, got {type(sample).__name__}")
        prompt = self.build_prompt(sample)
        self._ep = _Episode(sample=sample, prompt=prompt)
        info = self._info(tool=None, invalid=False, answer=None)
        if self.call_format is not None:
            info["tools"] = [sc.to_openai() for sc in self.tool_schemas]
        return prompt, info

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        """Apply one model turn; see the class docstring for ``info``.

        Raises:
            RuntimeError: ``reset`` was not called or the episode is over.
            TypeError: ``action`` is not a str.
        """
        ep = self._ep
        if ep is None or ep.done:
            raise RuntimeError("step() called before reset() or after the episode ended")
        if not isinstance(action, str):
            raise TypeError(f"action must be str, got {type(action).__name__}")
        ep.actions.append(action)
        turn = len(ep.actions)
        if self.call_format is not None:
            return self._step_native(action, turn)
        calls = [c for c in (t.find(action) for t in self.tools) if c is not None]
        call = min(calls, key=lambda c: c.start) if calls else None
        answer = self.extract_answer(action) if call is None else None
        last_turn = turn >= self.limits.max_turns
        if call is None and (answer is not None or self.invalid_action_reply is None):
            return self._finish(answer, terminated=True, truncated=False,
                                invalid=answer is None)
        if last_turn:  # a tool call or invalid action on the last allowed turn
            return self._finish(None, terminated=False, truncated=True, invalid=call is None)
        if call is None:
            obs = self.invalid_action_reply or ""
            return obs, 0.0, False, False, self._info(tool=None, invalid=True, answer=None)
        if ep.tool_calls >= self.limits.max_tool_calls:
            obs = self.render_limit_reached(call)
            return obs, 0.0, False, False, self._info(tool=call.tool, invalid=True, answer=None)
        tool = next(t for t in self.tools if t.name == call.tool)
        ep.tool_calls += 1
        obs = truncate_observation(tool.render(tool.run(call.payload)),
                                   self.limits.max_observation_chars)
        return obs, 0.0, False, False, self._info(tool=call.tool, invalid=False, answer=None)

    def _step_native(self, action: str, turn: int) -> tuple[str, float, bool, bool, dict[str, Any]]:
        """:meth:`step` in a native format: the same episode rules, every call of the turn run."""
        assert self.call_format is not None
        calls = self.call_format.parse(action)
        answer = self.extract_answer(action) if not calls else None
        if not calls and (answer is not None or self.invalid_action_reply is None):
            return self._finish(answer, terminated=True, truncated=False, invalid=answer is None)
        if turn >= self.limits.max_turns:
            return self._finish(None, terminated=False, truncated=True, invalid=not calls)
        if not calls:
            obs = self.invalid_action_reply or ""
            info = self._info(tool=None, invalid=True, answer=None)
            info.update(tool_error=False, observation_messages=[{"role": "user", "content": obs}])
            return obs, 0.0, False, False, info
        responses, kinds = zip(*(self._run_call(c) for c in calls), strict=True)
        ran = [r.name for r, k in zip(responses, kinds, strict=True) if k == "ran"]
        info = self._info(tool=ran[0] if ran else None, invalid=any(k != "ran" for k in kinds), answer=None)
        info.update(tool_error="malformed" in kinds, observation_messages=[r.message() for r in responses])
        return self.call_format.render(responses), 0.0, False, False, info

    def _run_call(self, call: ParsedCall) -> tuple[ToolResponse, str]:
        """Check and run one parsed call: ``(response, kind)``, kind ``ran`` | ``malformed`` (an
        ``error: <why>`` response) | ``limit`` (``max_tool_calls`` used up; nothing ran)."""
        ep = self._ep
        assert ep is not None

        def error(why: str, kind: str = "malformed") -> tuple[ToolResponse, str]:
            # a schema error quotes the offending value and an unknown tool its name: both are the
            # policy's and may be as long as its whole turn, so both are cut
            name = call.name if call.name is None or len(call.name) <= MAX_ERROR_NAME_CHARS else (
                call.name[:MAX_ERROR_NAME_CHARS] + "...")
            return ToolResponse(call.call_id, name, f"error: {clip(why, MAX_ERROR_CHARS)}", error=True), kind

        if call.error is not None:
            return error(call.error)
        tool = self.schema_tools.get(call.name or "")
        if tool is None:
            return error(f"unknown tool {clip(call.name or '', MAX_ERROR_NAME_CHARS)!r}; available tools: "
                         f"{', '.join(self.schema_tools)}")
        if ep.tool_calls >= self.limits.max_tool_calls:
            return error(f"tool call limit of {self.limits.max_tool_calls} reached; give your final answer",
                         "limit")
        try:
            content = tool.run_arguments(tool.schema.check_arguments(call.arguments))
        except ToolArgumentError as e:
            return error(str(e))
        ep.tool_calls += 1
        return ToolResponse(call.call_id, call.name, truncate_observation(
            str(content), self.limits.max_observation_chars)), "ran"

    def render_limit_reached(self, call: ToolCall) -> str:
        """Observation when ``max_tool_calls`` is exhausted (override to use the tool's tags)."""
        return f"\n[tool call limit of {self.limits.max_tool_calls} reached; give your answer]\n"

    def _finish(self, answer: str | None, *, terminated: bool, truncated: bool,
                invalid: bool) -> tuple[str, float, bool, bool, dict[str, Any]]:
        ep = self._ep
        assert ep is not None
        ep.done = True
        reward, comps = self.score(ep.sample, "".join(ep.actions), answer, ep.tool_calls)
        info = self._info(tool=None, invalid=invalid, answer=answer)
        info["reward_components"] = comps
        return "", float(reward), terminated, truncated, info

    def _info(self, *, tool: str | None, invalid: bool, answer: str | None) -> dict[str, Any]:
        ep = self._ep
        assert ep is not None
        return {"turn": len(ep.actions), "tool_calls": ep.tool_calls, "tool": tool,
                "invalid": invalid, "final_answer": answer, "reward_components": {},
                "sample_id": ep.sample.get("id")}
