"""The ``math_tool`` task: ReTool-style math with a Python sandbox.

Data: ``task.train_data`` (``math_train``, a JSONL path, ...; read from the data directory,
see :func:`environments.data.data_root`) with ``task.eval_data`` (default ``math500``) held
out; or, when ``task.train_data`` is empty, generated arithmetic problems (the CPU main job):
``task.max_train_samples`` (default 2000) training rows and the next ``task.max_eval_samples``
(default ``eval.num_samples``) rows of the same seeded stream held out. Service: one shared
bwrap :class:`~environments.sandbox.Sandbox` pool (2 workers) for all episodes. Warm start:
``retool_arithmetic`` traces.
"""

from __future__ import annotations

import random
from typing import TYPE_CHECKING

import environments
from environments.data import data_root

from ..base import Task
from .arithmetic import KINDS, arithmetic_splits, retool_arithmetic_samples
from .settings import MathToolSettings
from .traces import direct_answer_traces, retool_traces

if TYPE_CHECKING:
    import gymnasium

    from environments.sandbox import Sandbox

    from ...config import WarmStartConfig
    from ...config.specs import TaskSpec
    from ...warmstart.traces import Trace

#: Generated-problem kinds when ``task.settings.arithmetic_kinds`` is empty.
DEFAULT_KINDS = KINDS  # every kind of the problem generator


class MathToolTask(Task):
    """``math_tool``: math datasets or generated arithmetic, a shared sandbox pool.

    ``info``: ``{"sandbox": <what the sandbox enforces>}``. Settings: :class:`MathToolSettings`.
    """

    warm_start_kinds = ("retool_arithmetic", "gsm8k_solutions")
    settings_class = MathToolSettings
    settings: MathToolSettings
    service_names = "the sandbox pool"

    def __init__(self, spec: TaskSpec, env_id: str | None = None) -> None:
        super().__init__(spec, env_id)
        #: the shared sandbox pool (started by :meth:`start`; ``None`` before: envs start their own)
        self.sandbox: Sandbox | None = None

    def start(self) -> None:
        """Load (or generate) the splits and start the sandbox pool.

        Raises:
            FileNotFoundError / ValueError: a dataset is missing or malformed (see
                :func:`environments.math_tool.load_math`).
            SandboxUnavailableError: the sandbox cannot start.
        """
        from environments.math_tool import load_math

        spec, t = self.spec, self.spec.task
        data_dir = str(data_root(t.data_dir))
        if t.train_data:
            train = [r for name in t.train_data for r in load_math(name, data_dir)]
            evals = [r for name in (t.eval_data or ["math500"]) for r in load_math(name, data_dir)]
        else:
            n_train = t.max_train_samples or 2000
            n_eval = t.max_eval_samples or spec.eval_num_samples
            kinds = tuple(self.settings.arithmetic_kinds) or DEFAULT_KINDS
            train, evals = arithmetic_splits(n_train, n_eval, seed=spec.seed, kinds=kinds)
        self.train_samples = self.cap_train(train)
        self.eval_samples = self.cap_eval(evals)
        self.start_services()

    def start_services(self) -> None:
        """Start the shared sandbox pool (2 workers); ``info["sandbox"]``: what it enforces.

        Raises:
            SandboxUnavailableError: the sandbox cannot start.
        """
        from environments.sandbox import Sandbox, SandboxConfig

        self.sandbox = Sandbox(SandboxConfig(workers=2))
        self.add_closer(self.sandbox.close)
        self.info = {**self.info, "sandbox": self.sandbox.enforced}

    def make_env(self) -> gymnasium.Env:
        """A ``MathToolEnv`` on the task's shared sandbox pool, with ``task.env_kwargs``."""
        return environments.make(self.env_id, sandbox=self.sandbox, **self.env_kwargs)

    def warm_start_traces(self, ws: WarmStartConfig, *, progress: bool = True) -> list[Trace]:
        """``gsm8k_solutions`` traces (:meth:`_gsm8k_traces`), or ``retool_arithmetic`` traces:
        generated problems from their own seed stream
        (``10_000 + ws.seed``; problems of ``eval_samples`` filtered out), ``ws.num_examples``
        of them; a ``task.settings.tool_use_fraction`` solved with one ``<code>`` call whose output
        is copied into ``\\boxed{}``, the rest answered from the head (an estimate), shuffled with
        ``ws.seed``. Problem kinds: ``task.settings.arithmetic_kinds`` (empty: all).

        Args:
            ws: the ``warm_start`` section. progress: show progress bars.

        Returns:
            ``ws.num_examples`` traces.

        Raises:
            ConfigError: ``ws.kind`` is not one of :attr:`warm_start_kinds`.
            TraceError: the environment did not score a scripted arithmetic trace as expected.
        """
        self.check_warm_start(ws)
        n, seed = ws.num_examples, ws.seed
        held = {s.get("problem", s.get("question")) for s in self.eval_samples}
        if ws.kind == "gsm8k_solutions":
            return self._gsm8k_traces(n, seed, held, progress)
        pool = retool_arithmetic_samples(n + len(held), seed=10_000 + seed,
                                         kinds=tuple(self.settings.arithmetic_kinds) or DEFAULT_KINDS)
        samples = [s for s in pool if s["problem"] not in held][:n]
        n_tool = round(self.settings.tool_use_fraction * len(samples))
        traces = retool_traces(samples[:n_tool], self.make_env, progress=progress)
        traces += direct_answer_traces(samples[n_tool:], self.make_env, progress=progress)
        random.Random(seed).shuffle(traces)
        return traces

    def _gsm8k_traces(self, n: int, seed: int, held: set, progress: bool) -> list[Trace]:
        """``gsm8k_solutions`` traces (:func:`~.gsm8k.gsm8k_traces`): up to ``n`` from the rows of
        ``task.settings.warm_start_data`` (held-out problems left out), shuffled with ``seed``;
        rows are played until ``n`` traces are made (about 6 % of GSM8K's give none).

        Raises:
            ValueError: the dataset has no ``solution`` field in any row, or gives no trace.
        """
        from environments.math_tool import load_math

        from .gsm8k import gsm8k_traces

        rows = [r for r in load_math(self.settings.warm_start_data, str(data_root(self.spec.task.data_dir)))
                if r.get("problem") not in held]
        random.Random(seed).shuffle(rows)
        traces: list[Trace] = []
        pos = 0
        while len(traces) < n and pos < len(rows):  # a few rows more than missing: some give none
            want = n - len(traces)
            chunk = rows[pos:pos + want + want // 8 + 1]
            pos += len(chunk)
            traces += gsm8k_traces(chunk, self.make_env, progress=progress)[0]
        if not traces:
            raise ValueError(f"task.settings.warm_start_data={self.settings.warm_start_data!r}: no row "
                             "gave a gsm8k_solutions trace (rows need a 'solution' with <<calculator>> "
                             "annotations)")
        return traces[:n]


__all__ = ["DEFAULT_KINDS", "MathToolTask"]
