"""CheckpointManager: exact resume of model/optimizer/scheduler/RNG, pruning, crash safety (incl. SIGKILL)."""

from __future__ import annotations

import hashlib
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from trainer.outputs.checkpoint import MARKER, CheckpointError, CheckpointManager, rng_state, set_rng_state

REPO = Path(__file__).parent.resolve().parents[2]


def _make(seed: int):
    """A tiny MLP + AdamW + linear-warmup LambdaLR (the trainer's kind of optimizer/schedule)."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 5))
    return model, opt, sched


def _train_step(model, opt, sched, step: int) -> None:
    g = torch.Generator().manual_seed(1000 + step)  # data of step `step`, independent of global RNG
    x, y = torch.randn(16, 4, generator=g), torch.randn(16, 1, generator=g)
    opt.zero_grad()
    torch.nn.functional.mse_loss(model(x), y).backward()
    opt.step()
    sched.step()


def test_model_optimizer_scheduler_round_trip_is_bit_identical(tmp_path):
    n = 3
    # uninterrupted run: n + 1 steps
    ref_model, ref_opt, ref_sched = _make(0)
    for s in range(n + 1):
        _train_step(ref_model, ref_opt, ref_sched, s)

    # interrupted run: n steps, checkpoint, fresh objects (different init), restore, 1 step
    model, opt, sched = _make(0)
    for s in range(n):
        _train_step(model, opt, sched, s)
    mgr = CheckpointManager(tmp_path / "ckpt", keep_last=2)
    path = mgr.save(
        n,
        {
            "model": model.state_dict(),
            "optimizer": opt.state_dict(),
            "scheduler": sched.state_dict(),
            "data_cursor": {"epoch": 1, "index": 7},
        },
    )
    assert path == tmp_path / "ckpt" / "step_00000003"
    del model, opt, sched

    model2, opt2, sched2 = _make(123)
    assert not torch.equal(model2[0].weight, ref_model[0].weight)
    state = CheckpointManager(tmp_path / "ckpt").load()
    model2.load_state_dict(state["model"])
    opt2.load_state_dict(state["optimizer"])
    sched2.load_state_dict(state["scheduler"])
    assert state["data_cursor"] == {"epoch": 1, "index": 7}
    assert sched2.last_epoch == n
    _train_step(model2, opt2, sched2, n)

    for (name, p_ref), p in zip(ref_model.named_parameters(), model2.parameters(), strict=True):
        assert torch.equal(p_ref, p), name
    assert sched2.get_last_lr() == ref_sched.get_last_lr()
    assert torch.equal(
        opt2.state_dict()["state"][0]["exp_avg_sq"], ref_opt.state_dict()["state"][0]["exp_avg_sq"]
    )


def test_without_optimizer_state_the_step_differs(tmp_path):
    """Control for the test above: restoring only the model must NOT reproduce the run (AdamW moments)."""
    ref_model, ref_opt, ref_sched = _make(0)
    for s in range(4):
        _train_step(ref_model, ref_opt, ref_sched, s)
    model, opt, sched = _make(0)
    for s in range(3):
        _train_step(model, opt, sched, s)
    mgr = CheckpointManager(tmp_path)
    mgr.save(3, {"model": model.state_dict(), "scheduler": sched.state_dict()})
    model2, opt2, sched2 = _make(5)
    st = mgr.load()
    model2.load_state_dict(st["model"])
    sched2.load_state_dict(st["scheduler"])
    _train_step(model2, opt2, sched2, 3)
    assert not torch.equal(model2[0].weight, ref_model[0].weight)


def test_plain_python_objects_round_trip(tmp_path):
    mgr = CheckpointManager(tmp_path)
    state = {
        "data_cursor": {"epoch": 2, "order": [3, 1, 2], "index": 1},
        "prompt_ids": ["q-17", "q-4", "q-99"],
        "metrics_history": [{"step": 1, "reward": 0.25}, {"step": 2, "reward": float("nan")}],
        "policy_version": 12,
        "misc": (1, "a", None, {"nested": (2.5,)}),
        "t": torch.arange(6, dtype=torch.int64).reshape(2, 3),
    }
    mgr.save(12, state)
    got = mgr.load()
    assert set(got) == set(state)
    assert got["data_cursor"] == state["data_cursor"]
    assert got["prompt_ids"] == state["prompt_ids"]
    assert got["metrics_history"][0] == {"step": 1, "reward": 0.25}
    assert np.isnan(got["metrics_history"][1]["reward"])
    assert got["policy_version"] == 12
    assert got["misc"] == (1, "a", None, {"nested": (2.5,)})
    assert torch.equal(got["t"], state["t"])
    # one file per key + the marker, which lists them and the step
    path = mgr.latest()
    assert sorted(p.name for p in path.iterdir()) == sorted([f"{k}.pt" for k in state] + [MARKER])
    meta = json.loads((path / MARKER).read_text())
    assert meta["step"] == 12 and meta["keys"]["prompt_ids"] == "prompt_ids.pt"
    assert mgr.load(keys=["policy_version"]) == {"policy_version": 12}
    with pytest.raises(KeyError, match="nope"):
        mgr.load(keys=["nope"])


def _draws() -> tuple:
    return (
        random.random(),
        random.randint(0, 10**9),
        np.random.rand(3).tolist(),
        torch.rand(3).tolist(),
        torch.randint(0, 10**6, (2,)).tolist(),
    )


def test_rng_round_trip_through_checkpoint(tmp_path):
    random.seed(1)
    np.random.seed(2)
    torch.manual_seed(3)
    _draws()
    mgr = CheckpointManager(tmp_path)
    mgr.save(1, {"rng": rng_state()})
    expected = _draws()
    later = _draws()
    assert later != expected  # the streams moved on: restoring must bring them back
    set_rng_state(mgr.load()["rng"])
    assert _draws() == expected
    assert _draws() == later


def test_set_rng_state_rejects_incomplete_state():
    st = rng_state()
    del st["numpy"]
    with pytest.raises(KeyError, match="numpy"):
        set_rng_state(st)


def test_keep_last_prunes_oldest(tmp_path):
    mgr = CheckpointManager(tmp_path, keep_last=2)
    assert mgr.latest() is None and mgr.load() is None
    for s in (1, 2, 3, 5, 8):
        mgr.save(s, {"x": s})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_00000005", "step_00000008"]
    assert mgr.latest() == tmp_path / "step_00000008"
    assert [CheckpointManager.step_of(p) for p in mgr.checkpoints()] == [5, 8]
    assert mgr.load() == {"x": 8}
    assert mgr.load(tmp_path / "step_00000005") == {"x": 5}
    # step order is numeric, not lexicographic, beyond 8 digits too
    mgr.save(123456789, {"x": 0})
    assert mgr.latest().name == "step_123456789"
    # re-saving an existing step replaces it
    mgr.save(123456789, {"x": 1})
    assert mgr.load() == {"x": 1}
    assert len(mgr.checkpoints()) == 2


def test_bad_arguments_name_the_field(tmp_path):
    with pytest.raises(ValueError, match="keep_last"):
        CheckpointManager(tmp_path, keep_last=0)
    mgr = CheckpointManager(tmp_path)
    with pytest.raises(ValueError, match="step"):
        mgr.save(-1, {})
    with pytest.raises(ValueError, match="'a/b'"):
        mgr.save(1, {"a/b": 1})
    with pytest.raises(ValueError, match="COMPLETE"):
        mgr.save(1, {MARKER: 1})
    with pytest.raises(FileNotFoundError, match="not a complete checkpoint"):
        mgr.load(tmp_path / "step_00000042")
    with pytest.raises(ValueError, match="step_XXXXXXXX"):
        CheckpointManager.step_of("foo")
    assert list(tmp_path.iterdir()) == []  # nothing half-written by the rejected saves


def test_crash_before_rename_leaves_previous_checkpoint(tmp_path, monkeypatch):
    """A crash between writing the files (and marker) and the rename: the temp dir is never picked up."""
    mgr = CheckpointManager(tmp_path)
    mgr.save(1, {"x": 1})

    class Crash(BaseException):
        pass

    def crash(*args):
        raise Crash

    # exception path: the partial temp dir is cleaned up, step 1 is still latest
    monkeypatch.setattr(os, "rename", crash)
    with pytest.raises(Crash):
        mgr.save(2, {"x": 2, "y": torch.zeros(10)})
    monkeypatch.undo()
    assert mgr.latest() == tmp_path / "step_00000001"
    assert [p.name for p in tmp_path.iterdir()] == ["step_00000001"]

    # a hard crash leaves a temp dir (with all files and even the marker) and a step dir without marker
    tmp = tmp_path / ".tmp-step_00000002-999-deadbeef"
    tmp.mkdir()
    torch.save({"x": 2}, tmp / "x.pt")
    (tmp / MARKER).write_text(json.dumps({"step": 2, "keys": {"x": "x.pt"}}))
    nomarker = tmp_path / "step_00000003"
    nomarker.mkdir()
    torch.save(3, nomarker / "x.pt")
    # a marker listing a file that is missing is incomplete too
    missing = tmp_path / "step_00000004"
    missing.mkdir()
    (missing / MARKER).write_text(json.dumps({"step": 4, "keys": {"x": "x.pt"}}))

    fresh = CheckpointManager(tmp_path)
    assert fresh.latest() == tmp_path / "step_00000001"
    assert fresh.load() == {"x": 1}
    with pytest.raises(FileNotFoundError):
        fresh.load(nomarker)
    # the next successful save removes the temp leftover and replaces the incomplete step dir
    fresh.save(3, {"x": 33})
    assert not tmp.exists()
    assert fresh.load() == {"x": 33}


_KILL_SCRIPT = r"""
import sys, torch
from trainer.outputs.checkpoint import CheckpointManager
mgr = CheckpointManager(sys.argv[1], keep_last=3)
mgr.save(1, {"model": {"w": torch.ones(4)}, "cursor": 10})
print("saved 1", flush=True)
# a large save: 64 keys x 4 MiB, each written and fsync-ed; the parent kills us in the middle
big = {f"shard{i:02d}": torch.full((1024 * 1024,), float(i)) for i in range(64)}
big["cursor"] = 20
mgr.save(2, big)
print("saved 2", flush=True)
"""


def test_sigkill_during_large_save_is_ignored(tmp_path):
    ckdir = tmp_path / "ckpt"
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.Popen(
        [sys.executable, "-c", _KILL_SCRIPT, str(ckdir)], stdout=subprocess.PIPE, text=True, env=env, cwd=REPO
    )
    try:
        assert proc.stdout.readline().strip() == "saved 1"
        deadline = time.monotonic() + 60
        # wait until the big save has written a few shards, then kill it mid-write
        while time.monotonic() < deadline:
            tmps = [p for p in ckdir.iterdir() if p.name.startswith(".tmp-step_00000002")]
            if tmps and len(list(tmps[0].glob("shard*.pt"))) >= 3:
                break
            time.sleep(0.002)
        else:
            pytest.fail("the large save never started")
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == -signal.SIGKILL
    assert "saved 2" not in proc.stdout.read()
    proc.stdout.close()

    # killed mid-write: a temp dir without marker is left, step 2 does not exist
    leftovers = [p for p in ckdir.iterdir() if p.name.startswith(".tmp-")]
    assert len(leftovers) == 1 and not (leftovers[0] / MARKER).exists()
    assert not (ckdir / "step_00000002").exists()

    mgr = CheckpointManager(ckdir, keep_last=3)
    assert mgr.latest() == ckdir / "step_00000001"
    state = mgr.load()
    assert state["cursor"] == 10 and torch.equal(state["model"]["w"], torch.ones(4))
    # resuming and saving again works and clears the leftover
    mgr.save(2, {"cursor": 20})
    assert [p.name for p in sorted(ckdir.iterdir())] == ["step_00000001", "step_00000002"]
    assert mgr.load()["cursor"] == 20


# ------------------------------------------------ integrity and safe loading (issue 21 item 13)

def _three_checkpoints(tmp_path: Path) -> CheckpointManager:
    mgr = CheckpointManager(tmp_path / "ck", keep_last=3)
    for step in (1, 2, 3):
        mgr.save(step, {"model": {"w": torch.full((256,), float(step))}, "cursor": step, "rng": rng_state()})
    return mgr


def test_marker_records_size_and_sha256_of_every_file(tmp_path):
    mgr = _three_checkpoints(tmp_path)
    path = mgr.latest()
    files = json.loads((path / MARKER).read_text())["files"]
    assert sorted(files) == ["cursor.pt", "model.pt", "rng.pt"]
    for rel, rec in files.items():
        data = (path / rel).read_bytes()
        assert rec == {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    assert mgr.problem(path) is None


@pytest.mark.parametrize("damage", ["truncate", "flip"])
def test_resume_skips_a_torn_checkpoint_with_one_warning(tmp_path, caplog, damage):
    """A torn newest checkpoint (cut short, or same size with one byte changed) is skipped with a
    one-line warning naming it and the file; the previous intact one is loaded."""
    mgr = _three_checkpoints(tmp_path)
    f = mgr.directory / "step_00000003" / "model.pt"
    data = bytearray(f.read_bytes())
    if damage == "truncate":
        f.write_bytes(data[: len(data) // 2])
    else:
        data[len(data) // 2] ^= 0xFF
        f.write_bytes(bytes(data))
    with caplog.at_level("WARNING"):
        path, state = mgr.load_latest()
    assert path.name == "step_00000002" and state["cursor"] == 2
    assert torch.equal(state["model"]["w"], torch.full((256,), 2.0))
    (warning,) = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    why = {"truncate": "model.pt is missing or has another size",
           "flip": "model.pt does not match the SHA-256"}
    assert f"step_00000003: {why[damage]}" in warning and "\n" not in warning
    with pytest.raises(CheckpointError, match=f"step_00000003: {why[damage]}"):
        mgr.load(mgr.directory / "step_00000003")


@pytest.mark.parametrize("marker, why", [
    ("[]", "is list, not a JSON object"), ("null", "is NoneType, not a JSON object"),
    ("{}", "has no field 'keys'"), ('{"keys": ["model.pt"]}', "field 'keys' is not an object"),
    ('{"keys": {"model": "model.pt"}, "files": {"model.pt": 5}}', "field 'files' is not an object"),
])
def test_resume_skips_a_checkpoint_whose_marker_is_altered(tmp_path, caplog, marker, why):
    """Issue 21 item 13 (review): a ``COMPLETE`` marker that is valid JSON of the wrong shape (an
    altered marker) is a torn checkpoint like any other: skipped with one warning, the previous
    one loaded, ``load`` refusing it by name — never an AttributeError/KeyError traceback, never
    an empty state."""
    mgr = _three_checkpoints(tmp_path)
    (mgr.directory / "step_00000003" / MARKER).write_text(marker)
    with caplog.at_level("WARNING"):
        path, state = mgr.load_latest()
    assert path.name == "step_00000002" and state["cursor"] == 2
    (warning,) = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert f"step_00000003: its {MARKER} marker {why}" in warning
    assert [p.name for p in mgr.checkpoints()] == ["step_00000001", "step_00000002"]
    with pytest.raises(CheckpointError, match=f"its {MARKER} marker"):
        mgr.load(mgr.directory / "step_00000003")


def test_no_intact_checkpoint_is_one_error_naming_the_directory(tmp_path):
    mgr = _three_checkpoints(tmp_path)
    for step in (1, 2, 3):
        (mgr.directory / f"step_{step:08d}" / "cursor.pt").write_bytes(b"torn")
    with pytest.raises(CheckpointError, match=r"ck: none of its 3 checkpoint\(s\) is intact"):
        mgr.load_latest()
    assert CheckpointManager(tmp_path / "empty").load_latest() is None


def test_load_refuses_arbitrary_objects(tmp_path):
    """``weights_only=True``: a checkpoint file that unpickles a callable (here one that would
    write a file) is refused; nothing runs."""
    mgr = _three_checkpoints(tmp_path)
    path = mgr.latest()
    canary = tmp_path / "pwned"

    class Evil:
        def __reduce__(self):
            return (Path.touch, (canary,))

    torch.save({"x": Evil()}, path / "cursor.pt")
    meta = json.loads((path / MARKER).read_text())  # a consistent marker: the hash check passes
    data = (path / "cursor.pt").read_bytes()
    meta["files"]["cursor.pt"] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (path / MARKER).write_text(json.dumps(meta))
    with pytest.raises(Exception, match=r"Weights only load failed|Unsupported global"):
        mgr.load(path)
    assert not canary.exists()


def test_checkpoint_of_the_previous_format_still_loads(tmp_path):
    """A checkpoint written before this change (numpy RNG state as an ndarray, no ``files`` in the
    marker) loads with ``weights_only=True`` through the numpy-only allowlist."""
    d = tmp_path / "ck" / "step_00000004"
    d.mkdir(parents=True)
    np.random.seed(5)
    old_rng = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state(),
               "torch_cuda": None}
    torch.save(old_rng, d / "rng.pt")
    (d / MARKER).write_text(json.dumps({"step": 4, "keys": {"rng": "rng.pt"}, "time": 0.0}))
    path, state = CheckpointManager(tmp_path / "ck").load_latest()
    assert path == d
    set_rng_state(state["rng"])
    a = np.random.rand(3)
    np.random.seed(5)
    assert np.array_equal(a, np.random.rand(3))
