"""Settings of the ``math_tool`` task (``task.settings``; see :mod:`trainer.tasks.settings`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..settings import require
from .arithmetic import KINDS


@dataclass
class MathToolSettings:
    """The ``math_tool`` task's own knobs.

    Attributes:
        arithmetic_kinds: generated problems' kinds (``mul``, ``sum_of_products``, ``mul_minus``;
            empty = all), for runs without ``task.train_data`` (the generated training and
            held-out rows and the warm-start problems).
        tool_use_fraction: share in [0, 1] of the ``retool_arithmetic`` warm-start traces that use
            the interpreter; the rest answer from the head with an estimate, so RL has the
            decision to use the tool left to improve.
        warm_start_data: the dataset the ``gsm8k_solutions`` warm-start reads its solutions from
            (a name or JSONL path, as ``task.train_data``; rows with ``solution``).
    """

    arithmetic_kinds: list[str] = field(default_factory=list)
    tool_use_fraction: float = 1.0
    warm_start_data: str = "gsm8k_train"

    def __post_init__(self) -> None:
        """Raise :class:`~trainer.errors.ConfigError` naming ``task.settings.<key>`` on a bad value."""
        require(all(k in KINDS for k in self.arithmetic_kinds), "arithmetic_kinds", self.arithmetic_kinds,
                f"each must be one of {KINDS}")
        require(0.0 <= self.tool_use_fraction <= 1.0, "tool_use_fraction", self.tool_use_fraction,
                "must be in [0, 1]")
        require(isinstance(self.warm_start_data, str) and bool(self.warm_start_data), "warm_start_data",
                self.warm_start_data, "must be a dataset name or JSONL path")


__all__ = ["MathToolSettings"]
