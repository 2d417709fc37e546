"""Task-agnostic supervised warm start (ReTool / Search-R1 cold start): traces and SFT.

* :mod:`.traces` — the :class:`Trace` type and :func:`play_traces`, the loop that plays a
  task's scripted traces through its real environment. The traces themselves are the tasks'
  (``trainer/tasks/math_tool/traces.py``, ``trainer/tasks/search/traces.py``).
* :mod:`.sft` — next-token loss on action tokens only, each trace tokenised into a
  :class:`~trainer.rollout.trajectory.Trajectory` as the agent loop builds one (one mask producer).
* :mod:`.cache` — warm-starts shared between runs with identical settings.

Importing the package imports no torch (a task's traces are read when a config is validated);
the :mod:`.sft` names are imported on first access (PEP 562).
"""

from seams.lazy import lazy_exports

from .traces import Trace, TraceError, play_traces

__getattr__, __dir__ = lazy_exports(__name__, {
    "sft": ("action_token_loss", "sft_warm_start", "tokenize_trace", "trace_trajectory")})

__all__ = [
    "Trace",
    "TraceError",
    "action_token_loss",
    "play_traces",
    "sft_warm_start",
    "tokenize_trace",
    "trace_trajectory",
]
