"""Native tool calls the policy can write that once broke a tool instead of getting an error reply
(found by trying to break issue 15's formats):

* a lone UTF-16 surrogate escape (``"\\ud800"``) in a call's JSON is valid JSON syntax but not
  Unicode text: the sandbox raised ``UnicodeEncodeError`` from ``step`` (an ``env_error``, which
  ends a training run) and an MCP session died on it (every later call an infrastructure
  failure). It is now a malformed call: ``error: ...`` response, the episode goes on. A surrogate
  *pair* (an emoji) is one valid character and still runs.
* a schema error quotes the offending value and an unknown tool its name, both as long as the
  policy's turn: the error reply is now cut to ``MAX_ERROR_CHARS``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from environments.base import MAX_ERROR_CHARS
from environments.math_tool import MathToolEnv
from environments.tool_formats import HermesFormat, OpenAIFormat

SAMPLE = {"id": "m1", "problem": "What is 12345 * 6789?", "answer": "83810205"}
WHY = "a string holds a lone surrogate escape \\ud800 (not a Unicode character)"
LONE = f"error: invalid JSON in <tool_call>: {WHY}"


def hermes(name: str, arguments_json: str) -> str:
    return f'<tool_call>\n{{"name": "{name}", "arguments": {arguments_json}}}\n</tool_call>'


def test_lone_surrogate_in_a_hermes_call_is_an_error_reply_and_the_episode_goes_on(sandbox):
    env = MathToolEnv(sandbox=sandbox, tool_format="hermes")
    env.reset(options={"sample": SAMPLE})
    obs, r, term, trunc, info = env.step(hermes("python", '{"code": "print(\\"\\ud800\\")"}'))
    assert obs == f"\n<tool_response>\n{LONE}\n</tool_response>\n"
    assert (r, term, trunc, info["tool_calls"], info["invalid"], info["tool_error"]) == (
        0.0, False, False, 0, True, True)
    # also when "arguments" is a JSON string holding the escape
    obs, *_ = env.step(hermes("python", json.dumps(json.dumps({"code": 'print("\ud800")'}))))
    assert obs == ("\n<tool_response>\nerror: \"arguments\" of 'python' is a string that is not valid JSON: "
                   f"{WHY}\n</tool_response>\n")
    # a surrogate pair is one character (U+1F600) and runs
    obs, r, term, trunc, info = env.step(hermes("python", '{"code": "print(\\"\\ud83d\\ude00\\")"}'))
    assert obs == "\n<tool_response>\n\U0001f600\n</tool_response>\n" and info["tool_calls"] == 1
    assert env.step("\\boxed{83810205}")[1:3] == (1.0, True)


def test_lone_surrogate_in_an_openai_call_is_an_error_reply():
    calls = OpenAIFormat().parse('{"name": "python", "arguments": {"code": "\\udc00"}}')
    assert [(c.name, c.arguments, c.error) for c in calls] == [
        (None, None, "invalid JSON tool call: a string holds a lone surrogate escape \\udc00 "
                     "(not a Unicode character)")]
    # in a key too
    [call] = HermesFormat().parse(hermes("python", '{"\\ud800": 1}'))
    assert call.error == LONE.removeprefix("error: ")


def test_error_replies_are_cut_to_max_error_chars(sandbox):
    env = MathToolEnv(sandbox=sandbox, tool_format="hermes", limits={"max_observation_chars": 4096})
    env.reset(options={"sample": SAMPLE})
    value = "a" * 50_000
    _, _, _, _, info = env.step(hermes("python", json.dumps({"code": [value]})))
    [msg] = info["observation_messages"]
    why = f"python: argument 'code': ['{value}'] is not of type 'string'"
    more = f"...[{len(why) - MAX_ERROR_CHARS} more characters]"
    assert msg["content"] == f"error: {why[:MAX_ERROR_CHARS]}{more}"
    assert len(msg["content"]) == len("error: ") + MAX_ERROR_CHARS + len(more) < 600
    # an unknown tool's name is cut to 128 characters, in the reply and in the message's "name"
    name = "x" * 10_000
    _, _, _, _, info = env.step(hermes(name, "{}"))
    [msg] = info["observation_messages"]
    assert msg["content"] == (f"error: unknown tool '{'x' * 128}...[{10_000 - 128} more characters]'; "
                              "available tools: python")
    assert msg["name"] == "x" * 128 + "..."
    # short errors are unchanged
    _, _, _, _, info = env.step(hermes("python", '{"code": 5}'))
    content = info["observation_messages"][0]["content"]
    assert content == "error: python: argument 'code': 5 is not of type 'string'"


def test_lone_surrogate_does_not_break_an_mcp_session():
    pytest.importorskip("mcp")
    from environments.mcp_tool import StdioServer
    from environments.mcp_tool.env import McpToolEnv

    server = StdioServer(sys.executable, (str(Path(__file__).with_name("mcp_calc_server.py")),))
    env = McpToolEnv(server=server, tool_format="hermes")
    try:
        env.reset(options={"sample": {"question": "What is 2 + 3?", "answer": "5"}})
        obs, *_ = env.step(hermes("fail", '{"message": "\\ud800"}'))
        assert obs == f"\n<tool_response>\n{LONE}\n</tool_response>\n"
        assert env.toolset.session.alive  # the session survived: nothing was sent
        obs, *_ = env.step(hermes("add", '{"a": 2, "b": 3}'))
        assert obs == "\n<tool_response>\n5\n</tool_response>\n"
        assert env.step("<answer>5</answer>")[1:3] == (1.0, True)
    finally:
        env.close()
