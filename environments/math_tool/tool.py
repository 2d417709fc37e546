"""The ReTool Python interpreter tool: ``<code>```python ...```</code>`` → ``<interpreter>``."""

from __future__ import annotations

import ast
import re

from ..base import RegexTool
from ..sandbox import Sandbox, SandboxResult

CODE_PATTERN = re.compile(r"<code>\s*```(?:python|py)?[ \t]*\n(.*?)```\s*</code>", re.DOTALL)


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
    """Runs a fenced Python block in the sandbox and renders ``<interpreter>...</interpreter>``.

    Args:
        sandbox: a started :class:`~environments.sandbox.Sandbox` (shared between envs).
        timeout_s: wall-clock seconds per call; memory_mb: address-space MiB per call.
    """

    name = "python"
    pattern = CODE_PATTERN

    def __init__(self, sandbox: Sandbox, timeout_s: float = 10.0, memory_mb: int = 1024) -> None:
        self.sandbox, self.timeout_s, self.memory_mb = sandbox, timeout_s, memory_mb

    def run(self, payload: str) -> SandboxResult:
        """Execute ``payload`` (last bare expression printed) in the sandbox."""
        return self.sandbox.run(print_last_expression(payload), timeout_s=self.timeout_s,
                                memory_mb=self.memory_mb)

    def render(self, result: SandboxResult) -> str:
        """stdout, then (on failure) the error's last line or the kill reason."""
        text = result.stdout
        if not result.ok:
            lines = [ln for ln in result.stderr.strip().splitlines() if ln.strip()]
            failed = f"{result.status}: {result.reason}"
            err = lines[-1] if result.status == "error" and lines else failed
            text = (text + ("\n" if text and not text.endswith("\n") else "") + err)
        return f"\n<interpreter>\n{text.rstrip()}\n</interpreter>\n"
