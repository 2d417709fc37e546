"""Live console progress for training: step, reward, accuracy, staleness, masked fraction, tokens/s;
:func:`phase_bar`, a phase's bar (warm-start, trace generation, an evaluation) that is one line
when the output is not a terminal; :func:`report_console`, a console whose tables do not wrap in
a file."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Iterable, Iterator
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
        from rich.console import Console

        self.enabled = enabled
        self.tokens = 0.0
        console = Console(stderr=False)
        self._lines = not console.is_terminal  # no live bar (rich would draw its last frame at exit)
        self._p = Progress(TextColumn("[bold]RL"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                           TextColumn("ETA"), TimeRemainingColumn(), TextColumn("{task.fields[info]}"),
                           console=console, disable=not enabled or self._lines,
                           speed_estimate_period=WHOLE_RUN_S, get_time=clock)
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
        if self.enabled and self._lines:
            self._p.console.print(self.line(), markup=False, highlight=False, soft_wrap=True)

    def line(self) -> str:
        """The bar as one plain line: steps done / total, elapsed, ETA (``-:--:--`` before a rate
        is known) and the latest step's metrics."""
        t = self._p.tasks[0]
        eta = "-:--:--" if t.time_remaining is None else str(timedelta(seconds=round(t.time_remaining)))
        elapsed = str(timedelta(seconds=round(t.elapsed or 0.0)))
        return f"RL {t.completed:.0f}/{t.total:.0f} elapsed {elapsed} ETA {eta} {t.fields['info']}"


#: Width of :func:`report_console` when stdout is not a terminal (rich's default there is 80, and
#: its tables wrap their cells to fit; a file has no width).
FILE_WIDTH = 240


def report_console() -> Any:
    """A ``rich`` console on stdout: the terminal's width on a terminal, else :data:`FILE_WIDTH`
    columns (no colour codes), so a table written to a file or a pipe keeps each cell on one line."""
    from rich.console import Console

    if sys.stdout.isatty():
        return Console()
    return Console(width=FILE_WIDTH, force_terminal=False, no_color=True)


class PhaseLine:
    """A ``tqdm``-like bar that prints one line when its phase ends (``desc: n/total in 12.3 s
    (loss 0.123)``) instead of redrawing: what :func:`phase_bar` gives when stderr is not a terminal.
    Supports what the house's bars use: iteration, ``update``, ``set_postfix``, ``close``."""

    def __init__(self, iterable: Iterable[Any] | None, total: int | None, desc: str, show: bool) -> None:
        self.iterable, self.desc, self.show = iterable, desc, show
        self.total = total if total is not None else (len(iterable) if hasattr(iterable, "__len__") else None)
        self.n, self.postfix, self._t0, self._closed = 0, "", time.monotonic(), False

    def __iter__(self) -> Iterator[Any]:
        for item in self.iterable or ():
            yield item
            self.n += 1
        self.close()

    def update(self, n: int = 1) -> None:
        """Count ``n`` more items done."""
        self.n += n

    def set_postfix(self, **kw: Any) -> None:
        """Keep ``k=v`` values for the closing line."""
        self.postfix = ", ".join(f"{k} {v}" for k, v in kw.items())

    def close(self) -> None:
        """Print the phase's line once (when shown)."""
        if self._closed:
            return
        self._closed = True
        if self.show:
            of = f"/{self.total}" if self.total is not None else ""
            extra = f" ({self.postfix})" if self.postfix else ""
            print(f"{self.desc}: {self.n}{of} in {time.monotonic() - self._t0:.1f} s{extra}",
                  file=sys.stderr, flush=True)


def phase_bar(iterable: Iterable[Any] | None = None, *, total: int | None = None, desc: str,
              show: bool = True, leave: bool = True) -> Any:
    """A progress bar for one phase: ``tqdm`` when stderr is a terminal, else a :class:`PhaseLine`
    (one line when the phase ends: no carriage-return redraws in a log file).

    Args:
        iterable: what to iterate (or None with ``total`` and ``update``). total: items in all.
        desc: the label. show: False draws and prints nothing. leave: tqdm's ``leave``.
    """
    if sys.stderr.isatty():
        from tqdm.auto import tqdm

        return tqdm(iterable, total=total, desc=desc, disable=not show, leave=leave)
    return PhaseLine(iterable, total, desc, show)
