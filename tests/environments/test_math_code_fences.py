"""ReTool ``<code>`` blocks: the fence spellings models emit are tool calls (fault 4 of issue 9).

Table: block → the exact code handed to the sandbox (never a fence line); then real episodes
in the bubblewrap sandbox for several spellings, checking the ``<interpreter>`` output.
"""

from __future__ import annotations

import pytest

from environments.math_tool import MathToolEnv, PythonTool, extract_code

TWO_LINES = "x = 6 * 7\nprint(x)"

# (body between <code> and </code>, code sent to the sandbox)
BLOCKS = [
    ("\n```python\nx = 6 * 7\nprint(x)\n```\n", TWO_LINES),  # the prompt's own spelling
    ("\n``` python\nx = 6 * 7\nprint(x)\n```\n", TWO_LINES),  # space before the tag
    ("\n```Python\nx = 6 * 7\nprint(x)\n```\n", TWO_LINES),  # capital
    ("\n```PYTHON\nx = 6 * 7\nprint(x)\n```\n", TWO_LINES),
    ("\n```py\nx = 6 * 7\nprint(x)\n```\n", TWO_LINES),
    ("\n```Py\nx = 6 * 7\nprint(x)\n```\n", TWO_LINES),
    ("\n```python3\nx = 6 * 7\nprint(x)\n```\n", TWO_LINES),
    ("\n```  python3  \t\nx = 6 * 7\nprint(x)\n```\n", TWO_LINES),  # spaces around the tag
    ("\r\n```python\r\nx = 6 * 7\r\nprint(x)\r\n```\r\n", TWO_LINES),  # CRLF
    ("\n```\nx = 6 * 7\nprint(x)\n```\n", TWO_LINES),  # no language tag
    ("x = 6 * 7\nprint(x)", TWO_LINES),  # bare block, no fence
    ("\nx = 6 * 7\nprint(x)\n", TWO_LINES),
    ("print(42)", "print(42)"),
    ("\n```python\nx = 6 * 7\nprint(x)\n", TWO_LINES),  # closing fence missing
    ("\n```python\nx = 6 * 7\nprint(x)\n```   \n", TWO_LINES),  # spaces after closing fence
    ("\n```python\nx = 6 * 7\nprint(x)```\n", TWO_LINES),  # closing fence glued to the code
    ("\n````python\nx = 6 * 7\nprint(x)\n````\n", TWO_LINES),  # more than 3 backticks
    ("\n`````py\nx = 6 * 7\nprint(x)\n``````\n", TWO_LINES),  # longer closing fence is fine
    ("\n~~~python\nx = 6 * 7\nprint(x)\n~~~\n", TWO_LINES),  # tilde fence (CommonMark)
    ("\n~~~~\nx = 6 * 7\nprint(x)\n~~~~~\n", TWO_LINES),
    ("\n   ```python\n   x = 6 * 7\n   print(x)\n   ```\n", TWO_LINES),  # indented fence
    ("Let me compute:\n```python\nx = 6 * 7\nprint(x)\n```\nThat prints it.", TWO_LINES),
    ("\n```python\n\ndef f(n):\n    return n * 7\n\nprint(f(6))\n\n```\n",
     "def f(n):\n    return n * 7\n\nprint(f(6))"),  # inner blank lines and indentation kept
    # a 4-backtick fence keeps a 3-backtick line of a string literal as code (CommonMark)
    ('\n````python\ns = """\n```\n"""\nprint(len(s))\n````\n', 's = """\n```\n"""\nprint(len(s))'),
    ("`print(42)`", "print(42)"),  # inline code span
    ("", ""),
    ("\n```python\n```\n", ""),
]


@pytest.mark.parametrize(("body", "expected"), BLOCKS)
def test_extract_code_table(body, expected):
    assert extract_code(body) == expected
    call = PythonTool(sandbox=None).find(f"I will compute.\n<code>{body}</code>")
    assert call is not None and call.tool == "python" and call.payload == expected
    if "```" not in expected:  # no fence line reaches the sandbox
        assert not any(ln.lstrip().startswith(("```", "~~~")) for ln in call.payload.splitlines())


def test_not_a_tool_call_without_closing_tag():
    tool = PythonTool(sandbox=None)
    assert tool.find("<code>\n```python\nprint(1)\n```\n") is None
    assert tool.find("The answer is \\boxed{42}.") is None
    text = "a <code>print(1)</code> b <code>print(2)</code>"
    call = tool.find(text)
    assert (call.payload, text[call.start:call.end]) == ("print(1)", "<code>print(1)</code>")


SAMPLE = {"id": "f", "problem": "What is 6 * 7?", "answer": "42"}
RUN = [
    "\n``` python\nx = 6 * 7\nprint(x)\n```\n",
    "\n```Python\nx = 6 * 7\nprint(x)\n```\n",
    "\r\n```PY  \r\nx = 6 * 7\r\nprint(x)\r\n```  \r\n",
    "x = 6 * 7\nprint(x)",
    "\n````python\nx = 6 * 7\nx\n",  # no closing fence; last expression printed
    "\n~~~\nx = 6 * 7\nprint(x)\n~~~\n",
]


@pytest.mark.parametrize("body", RUN)
def test_env_runs_fence_spellings_in_sandbox(sandbox, body):
    env = MathToolEnv(sandbox=sandbox)
    try:
        env.reset(options={"sample": SAMPLE})
        obs, r, term, trunc, info = env.step(f"Compute it.\n<code>{body}</code>")
        assert obs == "\n<interpreter>\n42\n</interpreter>\n"
        assert (r, term, trunc, info["tool"], info["tool_calls"]) == (0.0, False, False,
                                                                      "python", 1)
        _, r, term, _, info = env.step("So \\boxed{42}.")
        assert (r, term, info["final_answer"]) == (1.0, True, "42")
    finally:
        env.close()


def test_env_syntax_error_is_reported_not_a_fence_line(sandbox):
    env = MathToolEnv(sandbox=sandbox)
    try:
        env.reset(options={"sample": SAMPLE})
        obs, *_ = env.step("<code>\n```python\nprint(6 * 7\n```\n</code>")
        assert obs.startswith("\n<interpreter>\n") and "SyntaxError" in obs
        assert "```" not in obs
    finally:
        env.close()


# -- a failing sandbox is an infrastructure failure, not an observation ----------------------------

def test_dead_sandbox_worker_is_retried_on_the_fresh_worker():
    """A worker killed between calls: the call is retried once and the policy sees real output."""
    import os
    import signal

    from environments.sandbox import Sandbox, SandboxConfig

    with Sandbox(SandboxConfig(workers=1)) as sb:
        tool = PythonTool(sb, timeout_s=5)
        assert tool.run("print(6 * 7)").stdout == "42\n"
        (worker,) = list(sb._all.values())
        os.killpg(worker.proc.pid, signal.SIGKILL)
        worker.proc.wait()
        res = tool.run("print(6 * 7)")
        assert res.ok and res.stdout == "42\n"
        assert "<interpreter>\n42\n</interpreter>" in tool.render(res)


def test_sandbox_failing_twice_or_closed_raises_infrastructure_error():
    from environments.errors import InfrastructureError
    from environments.sandbox import Sandbox, SandboxConfig, SandboxResult

    class AlwaysBrokenSandbox:  # a sandbox whose workers die on every call (the pool's own report)
        calls = 0

        def run(self, code, timeout_s=None, memory_mb=None):
            AlwaysBrokenSandbox.calls += 1
            return SandboxResult(stdout="", stderr="", exit_code=None, status="sandbox_error",
                                 reason="sandbox worker failed and was replaced: worker pipe closed")

    with pytest.raises(InfrastructureError, match=r"python sandbox failed twice for one call: sandbox worker "
                                                  r"failed and was replaced: worker pipe closed; sandbox"):
        PythonTool(AlwaysBrokenSandbox()).run("print(1)")
    assert AlwaysBrokenSandbox.calls == 2
    sb = Sandbox(SandboxConfig(workers=1))
    sb.close()
    with pytest.raises(InfrastructureError,
                       match=r"python sandbox unavailable: RuntimeError: Sandbox is closed"):
        PythonTool(sb).run("print(1)")
