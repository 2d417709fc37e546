"""``MathToolEnv``: ReTool-style multi-turn math with a sandboxed Python interpreter."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..base import EnvLimits, ToolCall, ToolEnv, check_prompt_template, with_overrides
from ..data import DEFAULT_DATA_DIR
from ..sandbox import Sandbox, SandboxConfig
from ..tool_formats import call_format
from .data import load_math
from .reward import MathReward, MathRewardConfig, extract_boxed
from .tool import PythonTool

PROMPT = (
    "Solve the following problem step by step. You can run Python code to help: write it as\n"
    "<code>\n```python\n# your code\n```\n</code>\n"
    "and its output will be returned between <interpreter> and </interpreter>. "
    "The value of a bare expression on the last line is printed. "
    "Put your final answer in \\boxed{{}}.\n\nProblem: {problem}\n"
)
#: Default prompt in the native tool-call formats (the chat template shows the tool's schema).
NATIVE_PROMPT = (
    "Solve the following problem step by step. You can call the python tool to run code; its "
    "output is returned to you. The value of a bare expression on the last line is printed. "
    "Put your final answer in \\boxed{{}}.\n\nProblem: {problem}\n"
)


@dataclass(frozen=True)
class MathToolConfig:
    """Settings of :class:`MathToolEnv` (validated).

    Attributes:
        dataset: ``math_train`` | ``math500`` | ``aime2024`` | ``aime2025`` or a JSONL path;
            ``None`` for no dataset (pass samples via ``reset(options={"sample": ...})``).
        data_dir: directory of the datasets (empty: ``$COPC_DATA_DIR``, else the repository's
            ``data/``; relative paths: from the current working directory).
        limit: read at most this many rows.
        code_timeout_s / code_memory_mb: per-call sandbox limits (seconds / MiB).
        limits: :class:`EnvLimits` (turns, tool calls, observation length).
        reward: :class:`MathRewardConfig`.
        sandbox: :class:`SandboxConfig` used when the env starts its own sandbox.
        prompt_template: ``str.format`` template with ``{problem}`` (left at the default
            :data:`PROMPT`, the native formats use :data:`NATIVE_PROMPT`).
        tool_format: ``tags`` (ReTool ``<code>`` → ``<interpreter>``) | ``hermes`` | ``openai``
            (the ``python(code)`` tool in JSON calls; :mod:`environments.tool_formats`).
    """

    dataset: str | None = None
    data_dir: str = DEFAULT_DATA_DIR
    limit: int | None = None
    code_timeout_s: float = 10.0
    code_memory_mb: int = 1024
    limits: EnvLimits = field(default_factory=lambda: EnvLimits(max_turns=8, max_tool_calls=8))
    reward: MathRewardConfig = field(default_factory=MathRewardConfig)
    sandbox: SandboxConfig = field(default_factory=lambda: SandboxConfig(workers=1))
    prompt_template: str = PROMPT
    tool_format: str = "tags"

    def __post_init__(self) -> None:
        check_prompt_template("MathToolConfig", self.prompt_template, "problem")
        call_format(self.tool_format, "MathToolConfig")
        if not isinstance(self.code_timeout_s, int | float) or not self.code_timeout_s > 0:
            raise ValueError(f"MathToolConfig.code_timeout_s={self.code_timeout_s!r}: must be a number > 0")
        if isinstance(self.code_memory_mb, bool) or not isinstance(self.code_memory_mb, int) \
                or self.code_memory_mb < 64:
            raise ValueError(f"MathToolConfig.code_memory_mb={self.code_memory_mb!r}: "
                             "must be an int >= 64 (MiB)")


class MathToolEnv(ToolEnv):
    """ReTool-style env: code calls run in the sandbox, the last ``\\boxed{}`` is the answer.

    ``tool_format: hermes`` / ``openai``: the same env with ``python(code)`` called in JSON
    (:data:`~environments.math_tool.tool.PYTHON_SCHEMA`); tags otherwise (the default).

    An action with a code block gets ``<interpreter>stdout / error</interpreter>``; an action
    without a code block ends the episode (it is the final answer, scored with
    :class:`MathReward` on all of the model's turns). Keyword overrides are fields of
    :class:`MathToolConfig`.

    Args:
        config: :class:`MathToolConfig`.
        sandbox: a shared started :class:`Sandbox`; if ``None`` the env starts its own on the
            first code call and closes it in :meth:`close`.
        samples: rows ``{"id", "problem", "answer"}`` (instead of ``config.dataset``).
    """

    stop_strings = ("</code>",)

    def __init__(self, config: MathToolConfig | None = None, sandbox: Sandbox | None = None,
                 samples: Sequence[Mapping[str, Any]] | None = None, **overrides: Any) -> None:
        cfg = config or MathToolConfig()
        if overrides:
            cfg = with_overrides(cfg, overrides)
        self.config = cfg
        if samples is None and cfg.dataset is not None:
            samples = load_math(Path(cfg.dataset) if cfg.dataset.endswith(".jsonl")
                                else cfg.dataset, cfg.data_dir, cfg.limit)
        self._own_sandbox = sandbox is None
        self._sandbox = sandbox
        self.reward_fn = MathReward(cfg.reward)
        self.python = PythonTool(_LazySandbox(self), cfg.code_timeout_s, cfg.code_memory_mb)
        super().__init__([self.python], cfg.limits, samples, invalid_action_reply=None,
                         tool_format=cfg.tool_format)

    @property
    def sandbox(self) -> Sandbox:
        """The sandbox (started on first use when the env owns it)."""
        if self._sandbox is None:
            self._sandbox = Sandbox(self.config.sandbox)
        return self._sandbox

    def build_prompt(self, sample: Mapping[str, Any]) -> str:
        """The problem inside the ReTool instruction template."""
        if "problem" not in sample:
            raise ValueError(f"math sample {sample.get('id')!r} has no 'problem' field")
        template = self.config.prompt_template
        if self.tool_format != "tags" and template == PROMPT:
            template = NATIVE_PROMPT
        return template.format(problem=sample["problem"])

    def extract_answer(self, action: str) -> str | None:
        """Content of the last ``\\boxed{}`` in the action."""
        return extract_boxed(action)

    def score(self, sample: Mapping[str, Any], response: str, answer: str | None,
              tool_calls: int) -> tuple[float, dict[str, float]]:
        """:class:`MathReward` of the final (answering) model turn against ``sample["answer"]``.

        Only the turn that ended the episode is scored, so a ``\\boxed{}`` inside earlier
        code (or any tool output) never counts as the answer.
        """
        if "answer" not in sample:
            raise ValueError(f"math sample {sample.get('id')!r} has no 'answer' field")
        final = self._ep.actions[-1] if (answer is not None and self._ep) else ""
        return self.reward_fn(final, str(sample["answer"]), tool_calls)

    def render_limit_reached(self, call: ToolCall) -> str:
        """Interpreter-style reply once ``max_tool_calls`` is used up."""
        return (f"\n<interpreter>\ntool call limit of {self.limits.max_tool_calls} reached; "
                "give your final answer\n</interpreter>\n")

    def close(self) -> None:
        """Stop the reward helper and the env's own sandbox."""
        self.reward_fn.close()
        if self._own_sandbox and self._sandbox is not None:
            self._sandbox.close()
            self._sandbox = None


class _LazySandbox:
    """Defers starting the env's sandbox until the first code call."""

    def __init__(self, env: MathToolEnv) -> None:
        self._env = env

    def run(self, code: str, timeout_s: float | None = None, memory_mb: int | None = None):
        """Forward to the env's sandbox."""
        return self._env.sandbox.run(code, timeout_s=timeout_s, memory_mb=memory_mb)
