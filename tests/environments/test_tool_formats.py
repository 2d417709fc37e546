"""Native tool-call formats: schemas, hermes / openai parsing and rendering, real episodes.

The math episodes run the real code tool in the real bwrap sandbox; the search episodes the real
BM25 searcher (in-process, on a few passages) behind the env's retriever interface.
"""

from __future__ import annotations

import json

import pytest

from environments.base import EnvLimits, RegexTool, SchemaTool, ToolArgumentError, ToolEnv, ToolSchema
from environments.math_tool import MathToolEnv
from environments.math_tool.env import NATIVE_PROMPT, PROMPT
from environments.math_tool.tool import PYTHON_SCHEMA
from environments.search import SearchEnv
from environments.search.env import NATIVE_INVALID_ACTION_REPLY, SEARCH_SCHEMA
from environments.tool_formats import HermesFormat, OpenAIFormat, ParsedCall, ToolResponse

SAMPLE = {"id": "m1", "problem": "What is 12345 * 6789?", "answer": "83810205"}
HERMES_CALL = '<tool_call>\n{"name": "python", "arguments": {"code": "x = 12345 * 6789\\nx"}}\n</tool_call>'


# -- schemas ---------------------------------------------------------------------------------------
def test_schema_openai_round_trip_and_argument_checks():
    spec = PYTHON_SCHEMA.to_openai()
    assert spec == {"type": "function", "function": {
        "name": "python", "description": PYTHON_SCHEMA.description,
        "parameters": {"type": "object", "properties": {"code": {
            "type": "string", "description": "The Python code to run."}}, "required": ["code"]}}}
    assert ToolSchema.from_openai(spec) == PYTHON_SCHEMA
    assert ToolSchema.from_openai(spec["function"]) == PYTHON_SCHEMA
    assert PYTHON_SCHEMA.check_arguments({"code": "1"}) == {"code": "1"}
    with pytest.raises(ToolArgumentError, match=r"^python: missing required argument 'code'$"):
        PYTHON_SCHEMA.check_arguments({"cod": "1"})
    with pytest.raises(ToolArgumentError, match=r"^python: argument 'code': 5 is not of type 'string'$"):
        PYTHON_SCHEMA.check_arguments({"code": 5})
    with pytest.raises(ToolArgumentError, match=r"^python: arguments must be a JSON object, got list"):
        PYTHON_SCHEMA.check_arguments(["1"])
    strict = ToolSchema("add", "a + b", {"type": "object", "additionalProperties": False,
                                         "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                                         "required": ["a", "b"]})
    assert strict.check_arguments({"a": 1, "b": 2}) == {"a": 1, "b": 2}
    with pytest.raises(ToolArgumentError, match=r"^add: missing required argument 'b'$"):
        strict.check_arguments({"a": 1})
    with pytest.raises(ToolArgumentError, match=r"^add: argument 'a': True is not of type 'integer'$"):
        strict.check_arguments({"a": True, "b": 2})
    with pytest.raises(ToolArgumentError, match=r"^add: Additional properties are not allowed \('c' was"):
        strict.check_arguments({"a": 1, "b": 2, "c": 3})


def test_schema_rejects_bad_declarations():
    with pytest.raises(ValueError, match=r"ToolSchema.name='my tool': must match"):
        ToolSchema("my tool", "d")
    with pytest.raises(ValueError, match=r"ToolSchema.parameters=.*tool 'x'.*\"type\": \"object\""):
        ToolSchema("x", "d", {"type": "string"})
    with pytest.raises(ValueError, match=r"tool 'x'\): not a valid JSON Schema: 5 is not of type 'object'$"):
        ToolSchema("x", "d", {"type": "object", "properties": 5})
    with pytest.raises(ValueError, match=r"ToolSchema.description=3"):
        ToolSchema("x", 3)
    assert isinstance(MathToolEnv().python, SchemaTool) and SEARCH_SCHEMA.name == "search"


# -- hermes ----------------------------------------------------------------------------------------
def test_hermes_parse_render_round_trip():
    fmt = HermesFormat()
    two = [("python", {"code": "print(1)"}), ("search", {"query": "capital of \"France\" é"})]
    text = fmt.format_calls(two)
    assert text == ('<tool_call>\n{"name": "python", "arguments": {"code": "print(1)"}}\n</tool_call>\n'
                    '<tool_call>\n{"name": "search", "arguments": {"query": "capital of \\"France\\" é"}}\n'
                    '</tool_call>')
    assert fmt.parse("I will compute.\n" + text + "\nthen answer") == [
        ParsedCall("call_0", "python", {"code": "print(1)"}),
        ParsedCall("call_1", "search", {"query": 'capital of "France" é'})]
    assert fmt.parse("no call, \\boxed{3}") == []
    # arguments given as a JSON string (some models), and no arguments at all
    assert fmt.parse('<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}</tool_call>') == [
        ParsedCall("call_0", "f", {"a": 1})]
    assert fmt.parse('<tool_call>{"name": "f"}</tool_call>') == [ParsedCall("call_0", "f", {})]
    responses = [ToolResponse("call_0", "python", "1"), ToolResponse("call_1", None, "error: x", error=True)]
    assert fmt.render(responses) == ("\n<tool_response>\n1\n</tool_response>\n"
                                     "<tool_response>\nerror: x\n</tool_response>\n")
    assert [r.message() for r in responses] == [
        {"role": "tool", "tool_call_id": "call_0", "name": "python", "content": "1"},
        {"role": "tool", "tool_call_id": "call_1", "content": "error: x"}]


@pytest.mark.parametrize(("action", "error"), [
    ('<tool_call>{"name": "python", "arguments": {"code": "1"}</tool_call>',
     "invalid JSON in <tool_call>: JSONDecodeError: Expecting ',' delimiter: line 1 column 46 (char 45)"),
    ("<tool_call></tool_call>", "invalid JSON in <tool_call>: JSONDecodeError: Expecting value: "
                                "line 1 column 1 (char 0)"),
    ('<tool_call>["python"]</tool_call>', 'a tool call must be a JSON object {"name": ..., '
                                          '"arguments": {...}}, got list'),
    ('<tool_call>{"arguments": {}}</tool_call>', 'the tool call has no "name" string'),
    ('<tool_call>{"name": "python", "arguments": [1]}</tool_call>',
     '"arguments" of \'python\' must be a JSON object, got list'),
    ('<tool_call>{"name": "python", "arguments": "{code"}</tool_call>',
     "\"arguments\" of 'python' is a string that is not valid JSON: Expecting property name enclosed in "
     "double quotes: line 1 column 2 (char 1)"),
    ('<tool_call>{"name": "python"', "unclosed <tool_call> (no </tool_call> after it)"),
    ("<tool_call>" + "[" * 100000 + "</tool_call>", None),  # too deep for json: an error, no crash
])
def test_hermes_malformed_calls_are_errors_not_crashes(action, error):
    (call,) = HermesFormat().parse(action)
    assert call.arguments is None and call.error is not None
    if error is not None:
        assert call.error == error
    else:
        assert call.error.startswith("invalid JSON in <tool_call>: RecursionError")


# -- openai ----------------------------------------------------------------------------------------
def test_openai_parse_render_round_trip():
    fmt = OpenAIFormat()
    text = fmt.format_calls([("python", {"code": "print(1)"}), ("search", {"query": "é"})])
    assert text == ('{"tool_calls": [{"id": "call_0", "type": "function", "function": {"name": "python", '
                    '"arguments": "{\\"code\\": \\"print(1)\\"}"}}, {"id": "call_1", "type": "function", '
                    '"function": {"name": "search", "arguments": "{\\"query\\": \\"é\\"}"}}]}')
    assert fmt.parse(text) == [ParsedCall("call_0", "python", {"code": "print(1)"}),
                               ParsedCall("call_1", "search", {"query": "é"})]
    # the other shapes: an assistant message with the model's ids, one tool_calls entry, a bare call
    # (arguments as an object, or Llama 3.x's "parameters"), surrounding whitespace
    msg = ('{"role": "assistant", "content": null, "tool_calls": [{"id": "abc", "type": "function", '
           '"function": {"name": "python", "arguments": "{\\"code\\": \\"1\\"}"}}]}')
    assert fmt.parse(msg) == [ParsedCall("abc", "python", {"code": "1"})]
    assert fmt.parse('{"type": "function", "function": {"name": "f", "arguments": {"a": 1}}}') == [
        ParsedCall("call_0", "f", {"a": 1})]
    assert fmt.parse('\n {"name": "f", "parameters": {"a": 2}} \n') == [ParsedCall("call_0", "f", {"a": 2})]
    assert fmt.parse('{"role": "assistant", "content": "hi", "tool_calls": null}') == []
    assert fmt.parse("The answer is \\boxed{3}.") == []
    (bad,) = fmt.parse('{"name": "f", "arguments": {"a": 1}')
    assert bad.error == ("invalid JSON tool call: JSONDecodeError: Expecting ',' delimiter: "
                         "line 1 column 36 (char 35)")
    (bad,) = fmt.parse('{"tool_calls": {"name": "f"}}')
    assert bad.error == '"tool_calls" must be a list, got dict'
    responses = [ToolResponse("abc", "python", "1\n2"), ToolResponse("call_1", "f", "error: é", error=True)]
    assert fmt.render(responses) == (
        '\n{"role": "tool", "tool_call_id": "abc", "name": "python", "content": "1\\n2"}\n'
        '{"role": "tool", "tool_call_id": "call_1", "name": "f", "content": "error: é"}\n')
    assert [json.loads(line) for line in fmt.render(responses).strip().split("\n")] == [
        r.message() for r in responses]


# -- math_tool episodes (real sandbox) -------------------------------------------------------------
def test_tags_format_is_unchanged(sandbox):
    env = MathToolEnv(sandbox=sandbox)
    assert env.tool_format == "tags" and env.stop_strings == ("</code>",) and env.tool_schemas == []
    prompt, info = env.reset(options={"sample": SAMPLE})
    assert prompt == PROMPT.format(problem=SAMPLE["problem"]) and "tools" not in info
    obs, r, term, trunc, info = env.step("<code>\n```python\nx = 12345 * 6789\nx\n```\n</code>")
    assert (obs, r, term, trunc) == ("\n<interpreter>\n83810205\n</interpreter>\n", 0.0, False, False)
    assert "tool_error" not in info and "observation_messages" not in info
    # a hermes call is plain text in the tags format: the action is the (wrong) final answer
    env.reset(options={"sample": SAMPLE})
    obs, r, term, _trunc, info = env.step(HERMES_CALL)
    assert (obs, r, term, info["invalid"], info["tool_calls"]) == ("", 0.0, True, True, 0)


def test_hermes_episode_runs_the_code_tool(sandbox):
    env = MathToolEnv(sandbox=sandbox, tool_format="hermes")
    assert env.stop_strings == ("</tool_call>",)
    prompt, info = env.reset(options={"sample": SAMPLE})
    assert prompt == NATIVE_PROMPT.format(problem=SAMPLE["problem"]) and "<code>" not in prompt
    assert info["tools"] == [PYTHON_SCHEMA.to_openai()]
    obs, r, term, trunc, info = env.step("Let me compute it.\n" + HERMES_CALL)
    assert obs == "\n<tool_response>\n83810205\n</tool_response>\n"
    assert (r, term, trunc, info["tool"], info["tool_calls"], info["invalid"], info["tool_error"]) == (
        0.0, False, False, "python", 1, False, False)
    assert info["observation_messages"] == [
        {"role": "tool", "tool_call_id": "call_0", "name": "python", "content": "83810205"}]
    # two calls in one turn run in order, each in a fresh process; a failing one shows its error
    obs, r, term, trunc, info = env.step(HermesFormat().format_calls([
        ("python", {"code": "```python\nprint(6 * 7)\n```"}), ("python", {"code": "1 / 0"})]))
    assert obs == ("\n<tool_response>\n42\n</tool_response>\n"
                   "<tool_response>\nZeroDivisionError: division by zero\n</tool_response>\n")
    assert info["tool_calls"] == 3 and not info["tool_error"]
    obs, r, term, trunc, info = env.step("So the answer is \\boxed{83810205}.")
    assert (obs, r, term, trunc, info["final_answer"], info["tool_calls"]) == (
        "", 1.0, True, False, "83810205", 3)


@pytest.mark.parametrize(("action", "content"), [
    ('<tool_call>\n{"name": "python", "arguments": {"code": "1"}\n</tool_call>',
     "error: invalid JSON in <tool_call>: JSONDecodeError: Expecting ',' delimiter: line 1 column 46 "
     "(char 45)"),
    ('<tool_call>\n{"name": "pyhton", "arguments": {"code": "1"}}\n</tool_call>',
     "error: unknown tool 'pyhton'; available tools: python"),
    ('<tool_call>\n{"name": "python", "arguments": {"cod": "1"}}\n</tool_call>',
     "error: python: missing required argument 'code'"),
    ('<tool_call>\n{"name": "python", "arguments": {"code": 7}}\n</tool_call>',
     "error: python: argument 'code': 7 is not of type 'string'"),
    ('<tool_call>\n{"name": "python", "arguments": "print(1)"}\n</tool_call>',
     "error: \"arguments\" of 'python' is a string that is not valid JSON: Expecting value: line 1 column 1 "
     "(char 0)"),
])
def test_hermes_malformed_call_gets_error_response_and_episode_goes_on(sandbox, action, content):
    env = MathToolEnv(sandbox=sandbox, tool_format="hermes")
    env.reset(options={"sample": SAMPLE})
    obs, r, term, trunc, info = env.step(action)
    assert obs == f"\n<tool_response>\n{content}\n</tool_response>\n"
    assert (r, term, trunc, info["tool"], info["tool_calls"], info["invalid"], info["tool_error"]) == (
        0.0, False, False, None, 0, True, True)
    assert info["observation_messages"][0]["content"] == content
    obs, r, term, trunc, info = env.step(HERMES_CALL)  # the episode goes on: a good call now runs
    assert obs == "\n<tool_response>\n83810205\n</tool_response>\n" and info["tool_calls"] == 1
    assert not info["tool_error"]
    assert env.step("\\boxed{83810205}")[1:3] == (1.0, True)


def test_hermes_limits_mixed_turn_and_last_turn(sandbox):
    env = MathToolEnv(sandbox=sandbox, tool_format="hermes", limits={"max_tool_calls": 2, "max_turns": 3,
                                                                     "max_observation_chars": 40})
    env.reset(options={"sample": SAMPLE})
    # one good call, one malformed, then two good calls over the limit of 2 executions
    action = "\n".join([HERMES_CALL, "<tool_call>{bad}</tool_call>",
                        HermesFormat().format_calls([("python", {"code": "print('a' * 100)"}),
                                                     ("python", {"code": "2"})])])
    obs, r, term, trunc, info = env.step(action)
    contents = [m["content"] for m in info["observation_messages"]]
    assert contents[0] == "83810205"
    assert contents[1].startswith("error: invalid JSON in <tool_call>: JSONDecodeError: Expecting property")
    # cut to 40 characters: the 34-character marker leaves 6 (3 head, 3 tail) of the 100 'a's
    assert contents[2] == "aaa\n...[truncated 94 characters]...\naaa"
    assert contents[3] == "error: tool call limit of 2 reached; give your final answer"
    assert (info["tool_calls"], info["tool"], info["invalid"], info["tool_error"]) == (
        2, "python", True, True)
    ids = [m["tool_call_id"] for m in info["observation_messages"]]
    assert ids == ["call_0", "call_1", "call_2", "call_3"]
    obs, r, term, trunc, info = env.step(HERMES_CALL)
    assert info["observation_messages"][0]["content"].endswith("limit of 2 reached; give your final answer")
    obs, r, term, trunc, info = env.step(HERMES_CALL)  # a call on the last allowed turn: truncated
    assert (obs, r, term, trunc, info["invalid"]) == ("", 0.0, False, True, False)


def test_openai_episode_runs_the_code_tool(sandbox):
    env = MathToolEnv(sandbox=sandbox, tool_format="openai")
    assert env.stop_strings == ()
    env.reset(options={"sample": SAMPLE})
    call = '{"name": "python", "arguments": "{\\"code\\": \\"12345 * 6789\\"}"}'
    obs, r, term, trunc, info = env.step(call)
    assert (r, term, trunc) == (0.0, False, False)
    assert obs == '\n{"role": "tool", "tool_call_id": "call_0", "name": "python", "content": "83810205"}\n'
    assert info["tool_calls"] == 1 and not info["tool_error"]
    obs, _r, term, _trunc, info = env.step('{"name": "python", "arguments": {"code": 1}}')
    assert json.loads(obs) == {"role": "tool", "tool_call_id": "call_0", "name": "python",
                               "content": "error: python: argument 'code': 1 is not of type 'string'"}
    assert info["tool_error"] and not term
    assert env.step("The product is \\boxed{83810205}.")[1:3] == (1.0, True)


def test_format_validation_and_schema_requirements():
    with pytest.raises(ValueError, match=r"^MathToolConfig.tool_format='xml': must be one of tags \| hermes "
                                         r"\| openai$"):
        MathToolEnv(tool_format="xml")

    class Echo(RegexTool):  # a user tool without a schema: fine in tags, refused natively
        name = "echo"

        def run(self, payload):
            return payload

        def render(self, result):
            return f"<echo>{result}</echo>"

    class EchoEnv(ToolEnv):
        def build_prompt(self, sample):
            return "say something"

        def extract_answer(self, action):
            return action

        def score(self, sample, response, answer, tool_calls):
            return 0.0, {}

    assert EchoEnv([Echo()]).tool_format == "tags"
    with pytest.raises(ValueError, match=r"^EchoEnv.tool_format='hermes': tool 'echo' has no ToolSchema"):
        EchoEnv([Echo()], tool_format="hermes")
    with pytest.raises(ValueError, match=r"^EchoEnv.tool_format='json': must be one of"):
        EchoEnv([Echo()], tool_format="json")
    Echo.schema = ToolSchema("echo", "Echo the text.", {"type": "object", "properties": {
        "input": {"type": "string"}}, "required": ["input"]})
    env = EchoEnv([Echo()], EnvLimits(max_turns=3), tool_format="hermes")
    env.reset(options={"sample": {}})
    obs, *_ = env.step(HermesFormat().format_calls([("echo", {"input": "hi"})]))
    assert obs == "\n<tool_response>\nhi\n</tool_response>\n"  # RegexTool.run_arguments: str(run(input))
    with pytest.raises(ValueError, match=r"two tools named 'echo'"):
        EchoEnv([Echo(), Echo()], tool_format="openai")


# -- search episodes (real BM25 searcher) ----------------------------------------------------------
PASSAGES = ['"Paris"\nParis is the capital and largest city of France.',
            '"Berlin"\nBerlin is the capital of Germany.',
            '"Lyon"\nLyon is a city in France on the Rhone.']


class BM25Retriever:
    """The env's retriever interface over an in-process bm25s index of :data:`PASSAGES`."""

    def __init__(self):
        from retriever.bm25 import BM25Config, BM25Searcher

        self.searcher = BM25Searcher.build(PASSAGES, BM25Config(), show_progress=False)

    def retrieve(self, queries, topk=None):
        rows, scores = self.searcher.search(list(queries), topk or 3)
        return [[{"document": {"id": str(i), "contents": PASSAGES[i]}, "score": float(s)}
                 for i, s in zip(r, sc, strict=True) if i >= 0] for r, sc in zip(rows, scores, strict=True)]


def test_search_hermes_episode():
    env = SearchEnv(retriever=BM25Retriever(), tool_format="hermes", topk=2)
    assert env.stop_strings == ("</tool_call>", "</answer>")
    prompt, info = env.reset(options={"sample": {"id": "q", "question": "capital of France",
                                                 "golden_answers": ["Paris"]}})
    assert "<search>" not in prompt and prompt.endswith("Question: capital of France?\n")
    assert info["tools"] == [SEARCH_SCHEMA.to_openai()]
    obs, r, term, trunc, info = env.step('<think>look up</think>\n<tool_call>\n{"name": "search", '
                                         '"arguments": {"query": "capital France"}}\n</tool_call>')
    assert obs == ("\n<tool_response>\nDoc 1(Title: Paris) Paris is the capital and largest city of France.\n"
                   "Doc 2(Title: Berlin) Berlin is the capital of Germany.\n</tool_response>\n")
    obs, r, term, trunc, info = env.step("I am not sure.")  # neither a call nor an answer
    assert (r, term, trunc) == (0.0, False, False)
    assert obs == NATIVE_INVALID_ACTION_REPLY and info["invalid"] and not info["tool_error"]
    assert info["observation_messages"] == [{"role": "user", "content": NATIVE_INVALID_ACTION_REPLY}]
    obs, r, term, _trunc, info = env.step("<answer> Paris </answer>")
    assert (r, term, info["final_answer"]) == (1.0, True, "Paris")


def test_hermes_example_config_validates(tmp_path):
    from trainer.config import load_config

    cfg = load_config("configs/examples/hermes_math.yaml")
    kwargs = dict(cfg.task.env_kwargs)
    assert cfg.task.env == "math_tool" and kwargs["tool_format"] == "hermes"
    assert cfg.rollout.use_chat_template
    env = MathToolEnv(**{k: v for k, v in kwargs.items() if k != "dataset"})
    assert env.tool_format == "hermes" and env.stop_strings == ("</tool_call>",)
    env.close()
