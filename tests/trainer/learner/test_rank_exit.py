"""Rank processes exit cleanly right after their last collective.

A gloo worker thread drops its reference to a finished collective's tensors after the waiting
thread woke; if that was the last reference to a Python-created tensor and the interpreter is
already finalizing, the process dies with ``terminate called without an active exception``
(SIGABRT). ``copc train`` under torchrun failed that way in about 1 of 3 runs (CI, 2026-12-01).
:func:`broadcast_command` holds its buffers until gloo released them (:func:`wait_released`)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch

from trainer.learner.distributed.collectives import wait_released

REPO = Path(__file__).parent.resolve().parents[2]


def test_wait_released_returns_once_the_other_reference_is_gone():
    t = torch.zeros(3)
    other = [t.view(3)]  # a second owner, as a gloo work holds a collective's tensors
    assert t._use_count() == 2
    threading.Timer(0.05, other.clear).start()
    t0 = time.monotonic()
    assert wait_released(t, timeout_s=5.0) is True
    assert 0.04 <= time.monotonic() - t0 < 4.0
    assert t._use_count() == 1


def test_wait_released_gives_up_after_the_timeout_without_raising():
    t = torch.zeros(1)
    keep = t.view(1)
    t0 = time.monotonic()
    assert wait_released(torch.ones(2), t, timeout_s=0.1) is False
    assert 0.09 <= time.monotonic() - t0 < 2.0
    assert t._use_count() == 2 and keep.shape == (1,)


def test_wait_released_with_sole_owners_returns_at_once():
    a, b = torch.zeros(2), torch.arange(4)
    t0 = time.monotonic()
    assert wait_released(a, b, timeout_s=0.0) is True
    assert time.monotonic() - t0 < 0.5


RANK_SCRIPT = textwrap.dedent("""
    import os, sys
    import torch.distributed as dist
    from trainer.learner.distributed.collectives import all_gather_objects
    from trainer.learner.distributed.worker import RankSpec, broadcast_command, init_rank

    rank = int(os.environ["RANK"])
    ctx = init_rank(RankSpec(rank=rank, world_size=2, local_rank=rank, local_world_size=2,
                             init_method="tcp://127.0.0.1:" + os.environ["PORT"], timeout_s=60), 1)
    msgs = [("step", {"lr": 1e-4, "uids": list(range(50))}), ("save", ("dir", 3))]
    for m in msgs:
        got = broadcast_command(m if rank == 0 else None, ctx)
        assert got == m, (rank, got, m)
    # the error report after a command: objects of different sizes, rank order
    errors = all_gather_objects(None if rank == 0 else ("error", "x" * 5000), ctx.cpu_group)
    assert errors == [None, ("error", "x" * 5000)], errors
    if os.environ["LAST"] == "shutdown":  # the normal end; "error": leave right after the report
        assert broadcast_command(("shutdown", ()) if rank == 0 else None, ctx) == ("shutdown", ())
    dist.destroy_process_group()
    print("ok", rank)
""")


@pytest.mark.slow
@pytest.mark.parametrize("last", ["shutdown", "error"])
def test_ranks_exiting_right_after_their_last_collective_never_abort(tmp_path, last):
    """10 pairs of real gloo ranks exit through normal interpreter finalization right after their
    last collective: the ``shutdown`` broadcast, or (a failed command) the error report gather.
    With ``broadcast_object_list`` / ``all_gather_object`` 2-3 of 10 pairs aborted here; every pair
    must exit 0 and every rank must have received every message."""
    script = tmp_path / "rank.py"
    script.write_text(RANK_SCRIPT)
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "LAST": last}
    failures = []
    for i in range(10):
        port = str(10_000 + (os.getpid() * 29 + i + (500 if last == "error" else 0)) % 20_000)
        procs = [subprocess.Popen([sys.executable, str(script)], env={**env, "RANK": str(r), "PORT": port},
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in (0, 1)]
        for r, p in enumerate(procs):
            out, err = p.communicate(timeout=120)
            if p.returncode != 0 or out.strip() != f"ok {r}":
                failures.append((i, r, p.returncode, err[-600:]))
    assert failures == []
