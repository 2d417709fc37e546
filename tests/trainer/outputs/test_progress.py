"""The RL progress bar (:class:`trainer.outputs.progress.TrainProgress`): step count, elapsed time,
an ETA and the step's key metrics, rendered as a terminal would show them."""

from __future__ import annotations

import io

from rich.console import Console

from trainer.outputs.progress import TrainProgress


def _render(p: TrainProgress) -> str:
    console = Console(file=io.StringIO(), width=200, force_terminal=False, color_system=None)
    console.print(p._p.make_tasks_table(p._p.tasks))
    return console.file.getvalue()


def test_the_rl_bar_shows_steps_done_an_eta_and_the_reward():
    p = TrainProgress(total_steps=24, start_step=0, enabled=True)
    before = _render(p)
    assert "0/24" in before and "ETA" in before and "-:--:--" in before  # no rate yet: ETA unknown
    p._p.start_task(p._task)
    p.update(1, {"rollout/reward_mean": 0.125, "perf/tokens": 800.0}, elapsed_s=80.0)
    p.update(2, {"rollout/reward_mean": 0.25, "perf/tokens": 800.0}, elapsed_s=160.0)
    after = _render(p)
    assert "2/24" in after and "reward 0.250" in after and "10 tok/s" in after, after
    assert "ETA" in after and "-:--:--" not in after, after  # two steps done: a remaining time


def test_without_a_terminal_every_step_prints_one_line(capsys):
    """Output sent to a file gets no live bar from rich: each update prints the bar as a line."""
    p = TrainProgress(total_steps=24, start_step=0, enabled=True)
    with p:
        p.update(1, {"rollout/reward_mean": 0.125, "perf/tokens": 800.0}, elapsed_s=80.0)
        p.update(2, {"rollout/reward_mean": 0.25, "perf/tokens": 800.0}, elapsed_s=160.0)
    out = capsys.readouterr().out
    lines = [x for x in out.splitlines() if x.startswith("RL ")]
    assert len(lines) >= 2 and lines[0].startswith("RL 1/24 elapsed ") and "reward 0.125" in lines[0], out
    assert lines[1].startswith("RL 2/24 ") and "ETA " in lines[1] and "10 tok/s" in lines[1], out
    q = TrainProgress(total_steps=24, enabled=False)
    with q:
        q.update(1, {"rollout/reward_mean": 0.5}, elapsed_s=1.0)
    assert "RL 1/24" not in capsys.readouterr().out


def test_the_eta_uses_the_whole_run_when_steps_take_minutes(capsys):
    """Steps 80 s apart (rich's default rate window is 30 s): after 2 of 24 steps the ETA is
    22 x 80 s = 0:29:20, on the bar and on the printed line."""
    now = [1000.0]
    p = TrainProgress(total_steps=24, start_step=0, enabled=True, clock=lambda: now[0])
    with p:
        for step in (1, 2):
            now[0] += 80.0
            p.update(step, {"rollout/reward_mean": 0.0, "perf/tokens": 800.0}, elapsed_s=80.0 * step)
    lines = [x for x in capsys.readouterr().out.splitlines() if x.startswith("RL 2/24")]
    assert lines and "elapsed 0:02:40 ETA 0:29:20" in lines[0], lines
    assert "0:29:20" in _render(p)
