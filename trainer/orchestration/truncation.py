"""A warning when a response cap truncates most of a step's episodes (issue 45, item 4).

A run whose ``rollout.max_new_tokens`` (or ``rollout.max_total_tokens``) cuts most answers trains
on cut-off text and learns nothing, while every step succeeds: the harness example on
SmolLM2 behind a 16-token cap did exactly that. :class:`TruncationMonitor` reads each step's
``rollout/truncated_fraction`` and ``rollout/max_new_tokens_cut_fraction``
(:func:`~trainer.orchestration.step_metrics.truncation_metrics`) and logs one warning line naming
the setting that cut, the first time and then at most every :attr:`TruncationSettings.every_steps`
steps.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TruncationSettings:
    """The caps a run samples with and when to warn about them.

    Attributes:
        max_new_tokens: ``rollout.max_new_tokens`` (tokens per model turn).
        max_total_tokens: ``rollout.max_total_tokens`` (tokens per episode).
        threshold: warn when more than this share of a step's episodes was cut (0.5).
        every_steps: at most one warning per this many steps (10).

    Raises:
        ValueError: ``threshold`` not in [0, 1) or ``every_steps`` < 1.
    """

    max_new_tokens: int
    max_total_tokens: int
    threshold: float = 0.5
    every_steps: int = 10

    def __post_init__(self) -> None:
        """Validate."""
        if not 0.0 <= self.threshold < 1.0:
            raise ValueError(f"TruncationSettings.threshold={self.threshold!r}: must be in [0, 1)")
        if self.every_steps < 1:
            raise ValueError(f"TruncationSettings.every_steps={self.every_steps!r}: must be >= 1")


class TruncationMonitor:
    """Warns, rate-limited, when a step's episodes were mostly cut by a token cap."""

    def __init__(self, settings: TruncationSettings) -> None:
        self.settings = settings
        self.last_warned: int | None = None  # the step of the latest warning

    def observe(self, step: int, metrics: dict[str, float]) -> str | None:
        """Check step ``step``'s metrics; log and return the warning line, or None.

        Args:
            step: the step just trained (1-based).
            metrics: its metrics with ``rollout/truncated_fraction`` and
                ``rollout/max_new_tokens_cut_fraction`` (absent: no warning).
        """
        s = self.settings
        cut = float(metrics.get("rollout/truncated_fraction", 0.0))
        if cut <= s.threshold:
            return None
        if self.last_warned is not None and step - self.last_warned < s.every_steps:
            return None
        self.last_warned = step
        by_new = float(metrics.get("rollout/max_new_tokens_cut_fraction", 0.0))
        by_total = cut - by_new
        parts = []
        if by_new > 0:
            parts.append(f"{by_new:.0%} by rollout.max_new_tokens={s.max_new_tokens}")
        if by_total > 0:
            parts.append(f"{by_total:.0%} by rollout.max_total_tokens={s.max_total_tokens}")
        raise_key = "rollout.max_new_tokens" if by_new >= by_total else "rollout.max_total_tokens"
        line = (f"step {step}: {cut:.0%} of the episodes were truncated by a token cap ({', '.join(parts)}); "
                f"the policy trains on cut-off responses: raise {raise_key} (next warning in "
                f"{s.every_steps} steps at the earliest; metric rollout/truncated_fraction)")
        log.warning(line)
        return line
