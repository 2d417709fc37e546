"""SIGTERM stops ``copc train`` as Ctrl-C does: the same ``--resume`` hint, a non-zero exit (143),
no traceback (issue 42 item 5b). A real ``copc train`` subprocess of a tiny config, sent SIGTERM
once its first step is checkpointed."""

from __future__ import annotations

import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from .test_run_e2e import overrides

CONFIG = "configs/math_tool/cpu_tiny.yaml"


def _ignore_sigint() -> None:
    """A child started as a background job of a non-interactive shell (``cmd &`` in a CI script)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)


@pytest.mark.parametrize("sigint", ["default", "ignored"])
def test_sigterm_after_the_first_step_prints_the_resume_hint(tmp_path, sigint):
    out = tmp_path / "run"
    # 100000 steps: the run must still be training when the signal comes (500 steps of this tiny
    # config finished in 108 s, before a starved test process had sent it)
    args = [a if a != "train.staleness.max=2" else "train.staleness.lag=1"  # cpu_tiny: fixed lag
            for a in overrides(out, "copc", steps=100_000)]
    cmd = [sys.executable, "-m", "trainer.cli", "train", "--config", CONFIG, *args]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=_ignore_sigint if sigint == "ignored" else None)
    try:
        deadline = time.monotonic() + 240
        while not any((out / "checkpoints").glob("step_*")) and proc.poll() is None:
            assert time.monotonic() < deadline, "no checkpoint within 240 s"
            time.sleep(0.2)
        assert proc.poll() is None, proc.communicate()
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 143, err
    assert "Traceback" not in err, err
    again = shlex.join(["copc", "train", "--config", CONFIG, *args, "--resume"])  # copy-pasteable
    assert err.endswith(f"copc train: terminated (SIGTERM); continue with: {again}\n"), err[-2000:]
    assert Path(out / "checkpoints").is_dir()
