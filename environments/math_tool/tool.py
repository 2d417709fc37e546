"""The ReTool Python interpreter tool: ``<code>```python ...```</code>`` → ``<interpreter>``.

A tool call is any ``<code>...</code>`` span (the first one in the action). The Python code
inside it is read the way Markdown (CommonMark, https://spec.commonmark.org/0.31.2/#fenced-code-blocks)
reads a fenced code block, plus the slips models commonly make:

* opening fence: a line of 3 or more backticks, or 3 or more tildes (``~~~``, also a
  CommonMark fence), indented by at most 3 spaces, then optional spaces and an optional info
  string (``python``, ``Python``, ``PYTHON``, ``py``, ``python3``, ``Py``, ... — any word: the
  env has one language, and CommonMark never makes the info string part of the code); text
  before the opening fence inside ``<code>`` is dropped;
* closing fence: a line of the same character, at least as long as the opening one, with
  optional trailing spaces; when it is missing the code runs to ``</code>``; a fence glued to
  the end of the last code line (``print(x)```) is removed too;
* no fence at all (``<code>print(1)</code>``): the whole block is the code;
* ``\\r\\n`` / ``\\r`` line endings become ``\\n``; indentation common to all code lines is
  removed (a fence indented inside a list); leading and trailing blank lines are dropped.

In the native tool-call formats (``tool_format`` ``hermes`` / ``openai``) the tool is
``python(code: string)`` (:data:`PYTHON_SCHEMA`); the ``code`` argument is read by the same
rules (a JSON string holding a fenced block works too), and the response is the
``<interpreter>`` body without the tags.

No fence line reaches the sandbox. (Only a Python string literal could hold a line of three
backticks; inside a block fenced with four or more, a shorter such line stays code, as in
CommonMark.)
"""

from __future__ import annotations

import ast
import re
import textwrap
from collections.abc import Mapping
from typing import Any

from ..base import RegexTool, ToolCall, ToolSchema
from ..errors import InfrastructureError
from ..sandbox import Sandbox, SandboxResult, SandboxUnavailableError
from ..sandbox.config import STATUS_SANDBOX_ERROR

#: A tool call: the first ``<code>...</code>`` span; group 1 is the raw block (fences included).
CODE_PATTERN = re.compile(r"<code>(.*?)</code>", re.DOTALL)
#: The tool's JSON schema (native tool-call formats).
PYTHON_SCHEMA = ToolSchema(
    name="python",
    description=("Run Python 3 code in a sandbox (no network, limited time and memory) and return its "
                 "standard output; on failure, the error's last line. The value of a bare expression "
                 "on the last line is printed. No state (variables, files) is kept between calls."),
    parameters={"type": "object",
                "properties": {"code": {"type": "string", "description": "The Python code to run."}},
                "required": ["code"]})
_OPEN_FENCE = re.compile(r"^ {0,3}(?P<fence>`{3,}|~{3,})[ \t]*(?P<info>[^\n]*?)[ \t]*$")


def _is_closing_fence(line: str, char: str, length: int) -> bool:
    s = line.strip(" \t")
    return (len(line) - len(line.lstrip(" ")) <= 3 and len(s) >= length
            and s == char * len(s))


def extract_code(block: str) -> str:
    """The Python code in the body of a ``<code>`` block (the text between the tags).

    Rules (CommonMark fenced code blocks plus common model slips) are in the module
    docstring. Returns the code with ``\\n`` line endings, no fence lines, no leading or
    trailing blank lines and no trailing newline; ``""`` for an empty block. Never raises.
    """
    text = block.replace("\r\n", "\n").replace("\r", "\n")
    lines = text.split("\n")
    body = lines
    for i, line in enumerate(lines):
        m = _OPEN_FENCE.match(line)
        if m is None or (m.group("fence")[0] == "`" and "`" in m.group("info")):
            continue
        char, length = m.group("fence")[0], len(m.group("fence"))
        body = lines[i + 1:]
        for j, inner in enumerate(body):
            if _is_closing_fence(inner, char, length):
                body = body[:j]
                break
        else:  # no closing fence line: drop a fence glued to the end of the last code line
            while body and not body[-1].strip():
                body = body[:-1]
            if body:
                body[-1] = re.sub(re.escape(char) + f"{{{length},}}[ \t]*$", "", body[-1])
        break
    else:
        # a one-line inline span ``<code>`print(1)`</code>`` / ```print(1)```: strip the ticks
        stripped = text.strip()
        if "\n" not in stripped and stripped.startswith("`") and stripped.endswith("`"):
            body = [stripped.strip("`")]
    code = textwrap.dedent("\n".join(body))
    return code.strip("\n").rstrip()


def print_last_expression(code: str) -> str:
    """Rewrite ``code`` so a bare expression on its last statement is printed (REPL style).

    ``x = 2\\nx * 3`` → prints ``6``; ``None`` values are not printed. Code that does not
    parse is returned unchanged (the sandbox then reports the SyntaxError).
    """
    try:
        tree = ast.parse(code)
    except SyntaxError:
        return code
    if not tree.body or not isinstance(tree.body[-1], ast.Expr):
        return code
    last = tree.body[-1]
    if (isinstance(last.value, ast.Call) and isinstance(last.value.func, ast.Name)
            and last.value.func.id == "print"):
        return code
    tmp = ast.Name(id="__copc_last__", ctx=ast.Store())
    assign = ast.Assign(targets=[tmp], value=last.value)
    show = ast.parse("if __copc_last__ is not None:\n    print(repr(__copc_last__) "
                     "if not isinstance(__copc_last__, str) else __copc_last__)").body[0]
    tree.body[-1:] = [assign, show]
    return ast.unparse(ast.fix_missing_locations(tree))


class PythonTool(RegexTool):
    """Runs the Python code of a ``<code>`` block in the sandbox, renders ``<interpreter>``.

    The code is read from the block by :func:`extract_code` (fenced or bare; see the module
    docstring). Natively (:data:`PYTHON_SCHEMA`): :meth:`run_arguments` with ``{"code": ...}``.

    Args:
        sandbox: a started :class:`~environments.sandbox.Sandbox` (shared between envs).
        timeout_s: wall-clock seconds per call; memory_mb: address-space MiB per call.
    """

    name = "python"
    pattern = CODE_PATTERN
    schema = PYTHON_SCHEMA
    payload_argument = "code"

    def __init__(self, sandbox: Sandbox, timeout_s: float = 10.0, memory_mb: int = 1024) -> None:
        self.sandbox, self.timeout_s, self.memory_mb = sandbox, timeout_s, memory_mb

    def find(self, text: str) -> ToolCall | None:
        """The first ``<code>...</code>`` span of ``text``; the payload is its code."""
        m = self.pattern.search(text)
        if m is None:
            return None
        return ToolCall(self.name, extract_code(m.group(1)), m.start(), m.end())

    def run_arguments(self, arguments: Mapping[str, Any]) -> str:
        """Run ``arguments["code"]`` (read by :func:`extract_code`); the :meth:`content` text.

        Raises:
            ToolArgumentError: ``arguments`` do not fit :data:`PYTHON_SCHEMA`.
            InfrastructureError: see :meth:`run`.
        """
        args = self.schema.check_arguments(arguments)
        return self.content(self.run(extract_code(args["code"])))

    def run(self, payload: str) -> SandboxResult:
        """Execute ``payload`` (last bare expression printed) in the sandbox.

        Limits hit by the code (timeout, memory, output, errors) are results the policy sees.
        A failure of the sandbox itself is not: a worker that died or hung (status
        ``sandbox_error``; the pool has replaced it) is retried once on the fresh worker.

        Raises:
            InfrastructureError: the sandbox failed twice for this call, cannot start a
                worker (``SandboxUnavailableError``) or was closed — an infrastructure
                failure, never shown to the policy or scored as a wrong answer.
        """
        code = print_last_expression(payload)
        reasons = []
        for _ in range(2):
            try:
                res = self.sandbox.run(code, timeout_s=self.timeout_s, memory_mb=self.memory_mb)
            except (SandboxUnavailableError, RuntimeError) as e:
                raise InfrastructureError(f"python sandbox unavailable: {type(e).__name__}: {e}") from e
            if res.status != STATUS_SANDBOX_ERROR:
                return res
            reasons.append(res.reason)
        raise InfrastructureError(f"python sandbox failed twice for one call: {'; '.join(reasons)}")

    def content(self, result: SandboxResult) -> str:
        """stdout, then (on failure) the error's last line or the kill reason; trailing
        whitespace removed."""
        text = result.stdout
        if not result.ok:
            lines = [ln for ln in result.stderr.strip().splitlines() if ln.strip()]
            failed = f"{result.status}: {result.reason}"
            err = lines[-1] if result.status == "error" and lines else failed
            text = (text + ("\n" if text and not text.endswith("\n") else "") + err)
        return text.rstrip()

    def render(self, result: SandboxResult) -> str:
        """:meth:`content` in ``\n<interpreter>\n...\n</interpreter>\n``."""
        return f"\n<interpreter>\n{self.content(result)}\n</interpreter>\n"
