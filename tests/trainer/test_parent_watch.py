"""Children that do not outlive their parent (issue 21 item 12, second half): a ``copc sweep``
killed with SIGKILL takes its ``copc train`` runs (and their sandbox workers) down with it; the
mechanism itself with real processes; ``copc eval --config`` holds the run directory's lock."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from trainer.cli import main as cli_main
from trainer.parent_watch import ENV, child_env, stop_when_parent_dies

REPO = Path(__file__).resolve().parents[2]
TINY = str(REPO / "configs/math_tool/cpu_tiny.yaml")


def _children(pid: int) -> list[int]:
    """Direct children of ``pid`` (from /proc/<pid>/task/*/children)."""
    out = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        with contextlib.suppress(OSError):
            out += [int(x) for x in (task / "children").read_text().split()]
    return out


def _descendants(pid: int) -> set[int]:
    todo, seen = [pid], set()
    while todo:
        for c in _children(todo.pop()):
            if c not in seen:
                seen.add(c)
                todo.append(c)
    return seen


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] not in "ZX"
    except (OSError, IndexError):
        return False


def _wait_gone(pids: set[int], timeout_s: float) -> set[int]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and any(_alive(p) for p in pids):
        time.sleep(0.2)
    return {p for p in pids if _alive(p)}


PARENT = """
import os, subprocess, sys, time
from trainer.parent_watch import child_env
child = subprocess.Popen([sys.executable, "-c", sys.argv[1]], env=child_env(os.environ))
print(child.pid, flush=True)
time.sleep(600)
"""

CHILD = """
import signal, sys, time
from trainer.parent_watch import stop_when_parent_dies
assert stop_when_parent_dies(grace_s=float(sys.argv[1]) if len(sys.argv) > 1 else 60.0, poll_s=0.1)
try:
    time.sleep(600)
except KeyboardInterrupt:
    print("interrupted cleanly", file=sys.stderr, flush=True)
    sys.exit(130)
"""


@pytest.mark.parametrize("sigint", ["default", "ignored"])
def test_child_is_interrupted_when_its_parent_is_killed(tmp_path, sigint):
    """Also when the child starts with SIGINT ignored (inherited through exec: a parent run in the
    background of a non-interactive shell, or under nohup, passes SIG_IGN on)."""
    env = dict(os.environ, PYTHONPATH=str(REPO))
    err = tmp_path / "child.err"
    ignore = (lambda: signal.signal(signal.SIGINT, signal.SIG_IGN)) if sigint == "ignored" else None
    with open(err, "w") as f:
        parent = subprocess.Popen([sys.executable, "-c", PARENT, CHILD], stdout=subprocess.PIPE, stderr=f,
                                  text=True, env=env, preexec_fn=ignore)
        child = int(parent.stdout.readline())
        time.sleep(0.5)
        assert _alive(child)
        parent.send_signal(signal.SIGKILL)
        parent.wait()
        assert _wait_gone({child}, 10.0) == set()
    text = err.read_text()
    assert f"the parent process (pid {parent.pid}) is gone" in text and "interrupted cleanly" in text


def test_child_that_ignores_sigint_is_ended_after_the_grace_time(tmp_path):
    # ignores SIGINT from after the watch is set up (the watch restores Ctrl-C only for a child
    # that inherited SIG_IGN at start-up: the test above)
    stubborn = CHILD.replace("poll_s=0.1)\n", "poll_s=0.1)\nsignal.signal(signal.SIGINT, signal.SIG_IGN)\n")
    assert stubborn != CHILD
    env = dict(os.environ, PYTHONPATH=str(REPO))
    parent = subprocess.Popen([sys.executable, "-c", PARENT.replace('sys.argv[1]]', 'sys.argv[1], "1.0"]'),
                               stubborn], stdout=subprocess.PIPE, text=True, env=env)
    child = int(parent.stdout.readline())
    time.sleep(0.5)
    parent.send_signal(signal.SIGKILL)
    parent.wait()
    t0 = time.monotonic()
    assert _wait_gone({child}, 10.0) == set()
    assert time.monotonic() - t0 >= 0.8  # SIGINT ignored: the grace time ran out first


def test_env_is_popped_and_checked(monkeypatch):
    monkeypatch.delenv(ENV, raising=False)
    assert stop_when_parent_dies() is False
    assert child_env({"A": "1"}) == {"A": "1", ENV: str(os.getpid())}
    monkeypatch.setenv(ENV, "nope")
    with pytest.raises(ValueError, match=f"{ENV}='nope': must be the parent's pid"):
        stop_when_parent_dies()
    assert ENV not in os.environ  # popped: the process's own children are not tied to it


@pytest.mark.slow
def test_killed_sweep_takes_its_runs_down(tmp_path):
    """A real 2-cell ``copc sweep --parallel 2`` is SIGKILLed while both ``copc train`` runs (with
    their sandbox workers) are running: within the grace time every one of its descendants is gone."""
    cheap = ["train.total_steps=100000", "train.prompts_per_step=2", "train.micro_batch_size=2",
             "warm_start.enabled=false", "eval.num_samples=2", "eval.k=1", "logging.tensorboard=false",
             "logging.plots=false", "logging.progress=false", "model.tiny.hidden_size=32",
             "model.tiny.intermediate_size=64", "model.tiny.num_layers=1", "rollout.max_new_tokens=12"]
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    sweep = subprocess.Popen([sys.executable, "-m", "trainer.cli", "sweep", "--config", TINY, "--out",
                              str(tmp_path / "sw"), "--grid", "algorithm.estimator_settings.eta_a=0.25,0.75",
                              "--parallel", "2",
                              *cheap], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                             cwd=REPO)
    try:
        deadline = time.monotonic() + 240
        runs: list[int] = []
        while time.monotonic() < deadline:
            runs = [c for c in _children(sweep.pid) if b"train" in Path(f"/proc/{c}/cmdline").read_bytes()]
            if len(runs) == 2 and all(_descendants(r) for r in runs):  # sandbox workers started
                break
            time.sleep(0.5)
        else:
            pytest.fail(f"the two runs never started: children {runs}")
        family = _descendants(sweep.pid)
        assert len(family) > 2  # the runs and their sandbox workers
        sweep.send_signal(signal.SIGKILL)
        sweep.wait()
        assert _wait_gone(family, 45.0) == set()
    finally:
        if sweep.poll() is None:
            sweep.kill()
            sweep.wait()


def test_eval_config_refuses_a_locked_run_directory(tmp_path, tiny_ckpt, capsys):
    """``copc eval --config`` writes ``<output_dir>/eval/``: while another process holds the run
    directory it exits 2 naming ``output_dir`` and the holder's pid."""
    out = tmp_path / "run"
    code = ("import time\nfrom trainer.outputs.lock import lock_output_dir\n"
            f"held = lock_output_dir({str(out)!r})\nprint('held', flush=True)\ntime.sleep(120)")
    holder = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                              env=dict(os.environ, PYTHONPATH=str(REPO)))
    try:
        assert holder.stdout.readline().strip() == "held"
        rc = cli_main(["eval", "--config", TINY, f"output_dir={out}", f"model.path={tiny_ckpt}"])
        assert rc == 2
        err = capsys.readouterr().err.strip().splitlines()[-1]
        assert f"output_dir={str(out)!r}: another copc process (pid {holder.pid}) is writing there" in err
    finally:
        holder.kill()
        holder.wait()
