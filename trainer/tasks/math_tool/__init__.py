"""The ``math_tool`` task in one folder: ReTool-style math with a Python sandbox.

* :mod:`.task` — :class:`MathToolTask` (data splits, the shared sandbox pool, the env factory).
* :mod:`.arithmetic` — generated arithmetic problems too hard for the head (disjoint splits).
* :mod:`.traces` — ``retool_arithmetic`` warm-start traces (a ``<code>`` call, the interpreter's
  output copied into ``\\boxed{}``; or a head estimate), played through the real env.
"""

from .arithmetic import KINDS, arithmetic_splits, expression_of, retool_arithmetic_samples
from .task import DEFAULT_KINDS, MathToolTask
from .traces import (
    SHORT_MATH_PROMPT,
    boxed_action,
    direct_answer_traces,
    estimate,
    retool_code_action,
    retool_traces,
)

__all__ = [
    "DEFAULT_KINDS",
    "KINDS",
    "SHORT_MATH_PROMPT",
    "MathToolTask",
    "arithmetic_splits",
    "boxed_action",
    "direct_answer_traces",
    "estimate",
    "expression_of",
    "retool_arithmetic_samples",
    "retool_code_action",
    "retool_traces",
]
