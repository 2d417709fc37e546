"""Live console progress for training: step, reward, accuracy, staleness, masked fraction, tokens/s."""

from __future__ import annotations

import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

#: rich's ``speed_estimate_period`` for the RL bar: longer than any run, so the ETA uses every step.
WHOLE_RUN_S = 10 * 365 * 86400.0


class TrainProgress:
    """A ``rich`` progress bar updated after every RL step, with elapsed time and ETA (no-op when
    disabled). When the console is not a terminal (output sent to a file, ``nohup``, a batch job),
    ``rich`` draws no live bar, so every update prints one line instead:
    ``RL 8/24 elapsed 0:10:40 ETA 0:21:20 reward ...``.

    The ETA is the rate over the whole run (rich's default estimates it over the last 30 s only,
    and an RL step often takes longer, which left the ETA unknown for the whole run).

    Args:
        total_steps: steps of the run. start_step: steps already done (resume).
        enabled: show it (False in tests / when ``logging.progress`` is off).
        clock: seconds since an arbitrary origin (default ``time.monotonic``; tests pass their own).
    """

    def __init__(self, total_steps: int, start_step: int = 0, enabled: bool = True,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.enabled = enabled
        self.tokens = 0.0
        self._p = Progress(TextColumn("[bold]RL"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                           TextColumn("ETA"), TimeRemainingColumn(), TextColumn("{task.fields[info]}"),
                           disable=not enabled, speed_estimate_period=WHOLE_RUN_S, get_time=clock)
        self._task = self._p.add_task("rl", total=total_steps, completed=start_step, info="")

    def __enter__(self) -> TrainProgress:
        self._p.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._p.__exit__(*exc)

    def update(self, step: int, m: dict[str, float], elapsed_s: float) -> None:
        """Show the latest step's key metrics."""
        self.tokens += m.get("perf/tokens", 0.0)
        info = (f"reward {m.get('rollout/reward_mean', 0):.3f} acc {m.get('rollout/accuracy', 0):.2f} "
                f"stale {m.get('staleness/mean', 0):.1f}/{m.get('staleness/max', 0):.0f} "
                f"masked {m.get('actor/dis_masked_frac', 0):.3f} "
                f"{self.tokens / max(elapsed_s, 1e-9):.0f} tok/s")
        self._p.update(self._task, completed=step, info=info)
        if self.enabled and not self._p.console.is_terminal:
            self._p.console.print(self.line(), markup=False, highlight=False, soft_wrap=True)

    def line(self) -> str:
        """The bar as one plain line: steps done / total, elapsed, ETA (``-:--:--`` before a rate
        is known) and the latest step's metrics."""
        t = self._p.tasks[0]
        eta = "-:--:--" if t.time_remaining is None else str(timedelta(seconds=round(t.time_remaining)))
        elapsed = str(timedelta(seconds=round(t.elapsed or 0.0)))
        return f"RL {t.completed:.0f}/{t.total:.0f} elapsed {elapsed} ETA {eta} {t.fields['info']}"
