"""ReTool / Search-R1 style cold start: scripted traces from the real environments, and SFT.

* :mod:`.arithmetic` — hard-for-the-head arithmetic problems (disjoint splits by offset).
* :mod:`.traces` — traces produced by stepping the real ``MathToolEnv``.
* :mod:`.search_traces` — Search-R1 traces against the real ``SearchEnv`` and retriever.
* :mod:`.sft` — next-token loss on action tokens only, tokenised as the agent loop does.
"""

from .arithmetic import arithmetic_splits, expression_of, retool_arithmetic_samples
from .search_traces import copied_answer, reformulated_query, search_r1_traces
from .sft import action_token_loss, sft_warm_start, tokenize_trace
from .traces import (
    SHORT_MATH_PROMPT,
    SHORT_SEARCH_PROMPT,
    Trace,
    TraceError,
    boxed_action,
    direct_answer_traces,
    estimate,
    retool_code_action,
    retool_traces,
    search_r1_samples,
)

__all__ = [
    "SHORT_MATH_PROMPT",
    "SHORT_SEARCH_PROMPT",
    "Trace",
    "TraceError",
    "action_token_loss",
    "arithmetic_splits",
    "boxed_action",
    "copied_answer",
    "direct_answer_traces",
    "estimate",
    "expression_of",
    "reformulated_query",
    "retool_arithmetic_samples",
    "retool_code_action",
    "retool_traces",
    "search_r1_samples",
    "search_r1_traces",
    "sft_warm_start",
    "tokenize_trace",
]
