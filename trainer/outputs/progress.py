"""Live console progress for training: step, reward, accuracy, staleness, masked fraction, tokens/s."""

from __future__ import annotations

from typing import Any

from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)


class TrainProgress:
    """A ``rich`` progress bar updated after every RL step, with elapsed time and ETA (no-op when
    disabled).

    Args:
        total_steps: steps of the run. start_step: steps already done (resume).
        enabled: show it (False in tests / when ``logging.progress`` is off).
    """

    def __init__(self, total_steps: int, start_step: int = 0, enabled: bool = True) -> None:
        self.enabled = enabled
        self.tokens = 0.0
        self._p = Progress(TextColumn("[bold]RL"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                           TextColumn("ETA"), TimeRemainingColumn(), TextColumn("{task.fields[info]}"),
                           disable=not enabled)
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
