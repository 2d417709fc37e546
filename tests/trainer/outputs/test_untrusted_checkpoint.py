"""Issue 44 item 3: nothing loaded from a checkpoint or run directory runs code or reaches outside it.

Real files throughout: checkpoints written by the real :class:`CheckpointManager`, a real DCP
checkpoint (``torch.distributed.checkpoint.save`` in this process) whose ``.metadata`` is then replaced
by a pickle that would write a marker file when unpickled (the ``COMPLETE`` marker hashes it, as a
crafted checkpoint would), crafted ``COMPLETE`` markers, a symlinked run-directory lock.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import pickle
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from trainer.errors import ConfigError
from trainer.learner.distributed.safe_dcp import (
    UnsafeCheckpointError,
    check_dcp_tree,
    read_dcp_metadata,
    safe_dcp_load,
)
from trainer.outputs.checkpoint import MARKER, CheckpointError, CheckpointManager, DirectoryState
from trainer.outputs.lock import LOCK_FILE, lock_output_dir


class _WritesMarker:
    """Unpickles as ``exec(code)``: the code writes ``path`` (what a crafted checkpoint would do)."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self):
        return exec, (f"open({str(self.path)!r}, 'w').write('pwned')",)


def _state() -> dict:
    return {"actor": {"w": torch.arange(12.0).reshape(3, 4)},
            "actor_opt": {"param_groups": [{"lr": 0.5, "betas": (0.9, 0.99), "params": ["w"]}]}}


def _crafted_dcp_checkpoint(root: Path, pwned: Path, *, value: bool = False) -> Path:
    """A complete checkpoint whose ``learner_shards/dcp`` is a real DCP save with its ``.metadata``
    (or, with ``value``, one non-tensor value's bytes) replaced by the code-running pickle."""
    def write(d: Path) -> None:
        dcp.save(_state(), checkpoint_id=str(d / "dcp"))
        if not value:
            (d / "dcp" / ".metadata").write_bytes(pickle.dumps(_WritesMarker(pwned)))
            return
        md = read_dcp_metadata(d / "dcp" / ".metadata")
        info = next(v for k, v in md.storage_data.items() if k.fqn == "actor_opt.param_groups.0.lr")
        data_file = d / "dcp" / info.relative_path
        evil = _pickled_torch_save(_WritesMarker(pwned))
        info.offset, info.length = data_file.stat().st_size, len(evil)  # the value now points at it
        with open(data_file, "ab") as fh:
            fh.write(evil)
        (d / "dcp" / ".metadata").write_bytes(pickle.dumps(md))

    return CheckpointManager(root, 1).save(1, {"learner": {"sharded": True},
                                                "learner_shards": DirectoryState(write)})


def _pickled_torch_save(obj) -> bytes:
    import io
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def test_honest_dcp_checkpoint_round_trips_through_the_safe_reader(tmp_path):
    """The safe reader loads what ``dcp.save`` wrote: tensors and plain values equal."""
    path = CheckpointManager(tmp_path, 1).save(1, {"learner_shards": DirectoryState(
        lambda d: dcp.save(_state(), checkpoint_id=str(d / "dcp")))})
    assert check_dcp_tree(path / "learner_shards") == 1
    target = {"actor": {"w": torch.zeros(3, 4)},
              "actor_opt": {"param_groups": [{"lr": 0.0, "betas": (0.0, 0.0), "params": ["x"]}]}}
    safe_dcp_load(target, path / "learner_shards" / "dcp")
    assert torch.equal(target["actor"]["w"], torch.arange(12.0).reshape(3, 4))
    assert target["actor_opt"]["param_groups"] == [{"lr": 0.5, "betas": (0.9, 0.99), "params": ["w"]}]


@pytest.mark.parametrize("value", [False, True], ids=["metadata", "non-tensor value"])
def test_crafted_dcp_pickle_is_refused_and_runs_nothing(tmp_path, value):
    """A crafted DCP checkpoint (intact per its marker) is refused in one line by the check the
    distributed learner runs before its ranks load, and by the ranks' reader itself; the pickle's
    code never runs (its marker file is never written). Stock ``dcp.load`` on the same files runs it
    (the exploit is real)."""
    pwned = tmp_path / "pwned"
    path = _crafted_dcp_checkpoint(tmp_path / "ckpts", pwned, value=value)
    shards = CheckpointManager(tmp_path / "ckpts", 1).load(path)["learner_shards"]  # hashes match
    if not value:
        with pytest.raises(UnsafeCheckpointError) as err:
            check_dcp_tree(shards)
        assert isinstance(err.value, ConfigError)
        assert str(err.value) == (f"{shards / 'dcp' / '.metadata'}: refused, it would call builtins.exec "
                                  "when unpickled (not DCP metadata; a crafted checkpoint?)")
    with pytest.raises(UnsafeCheckpointError) as err:
        safe_dcp_load(_state(), shards / "dcp")
    assert len(str(err.value).splitlines()) == 1
    assert ("builtins.exec" in str(err.value)) if not value else \
        str(err.value).startswith("DCP value 'actor_opt.param_groups.0.lr': refused, not plain data")
    assert not pwned.exists()
    with contextlib.suppress(CheckpointException):  # stock dcp.load runs the code (then fails or not)
        dcp.load(_state(), checkpoint_id=str(shards / "dcp"))
    assert pwned.read_text() == "pwned"


def test_dcp_metadata_naming_a_data_file_outside_is_refused(tmp_path):
    """A ``.metadata`` (built from allowed classes only) whose storage record names ``../x.distcp``
    is refused naming the file, before any data file is opened."""
    path = CheckpointManager(tmp_path / "c", 1).save(1, {"learner_shards": DirectoryState(
        lambda d: dcp.save(_state(), checkpoint_id=str(d / "dcp")))})
    meta_file = path / "learner_shards" / "dcp" / ".metadata"
    md = read_dcp_metadata(meta_file)
    for info in md.storage_data.values():
        info.relative_path = "../../../outside.distcp"
    meta_file.write_bytes(pickle.dumps(md))
    with pytest.raises(UnsafeCheckpointError,
                       match=r"data file '\.\./\.\./\.\./outside\.distcp' is not a file name inside"):
        check_dcp_tree(path / "learner_shards")


def _rewrite_marker(path: Path, **changes) -> None:
    meta = json.loads((path / MARKER).read_text())
    meta.update(changes)
    (path / MARKER).write_text(json.dumps(meta))


def test_marker_pointing_outside_the_checkpoint_is_refused(tmp_path):
    """A crafted ``COMPLETE`` marker naming ``../../x.pt`` (a real ``torch.save`` file with its real
    size and hash), an absolute shards directory, or a listed file that is a symlink out: each is
    refused by ``load`` in one line naming the path (it loaded the outside file before)."""
    outside = tmp_path / "x.pt"
    torch.save({"step": 666}, outside)
    rec = {"size": outside.stat().st_size, "sha256": hashlib.sha256(outside.read_bytes()).hexdigest()}
    mgr = CheckpointManager(tmp_path / "run" / "checkpoints", 3)

    a = mgr.save(1, {"loop": {"step": 1}})
    _rewrite_marker(a, keys={"loop": "../../../x.pt"}, files={"../../../x.pt": rec})
    with pytest.raises(CheckpointError) as err:
        mgr.load(a)
    assert str(err.value) == (f"{a}: {MARKER} names '../../../x.pt', which is not a relative path inside the "
                              "checkpoint (absolute, '..' or empty part)")

    shards = tmp_path / "elsewhere"
    shards.mkdir()
    b = mgr.save(2, {"loop": {"step": 2}})
    _rewrite_marker(b, dirs={"learner_shards": str(shards)})
    with pytest.raises(CheckpointError, match=rf"names '{shards}', which is not a relative path inside"):
        mgr.load(b)

    c = mgr.save(3, {"loop": {"step": 3}})
    (c / "loop.pt").unlink()
    os.symlink(outside, c / "loop.pt")
    _rewrite_marker(c, files={"loop.pt": rec})
    with pytest.raises(CheckpointError) as err:
        mgr.load(c)
    assert str(err.value) == (f"{c}: {MARKER} names 'loop.pt', which is a symlink "
                              f"(loop.pt -> {str(outside)!r}); refused")
    assert mgr.latest() is None and mgr.problem(c) == str(err.value)


def test_symlink_inside_a_shards_directory_is_refused(tmp_path):
    """A symlink planted under a ``dirs`` directory (not listed by the marker) makes the checkpoint
    not intact, naming it."""
    mgr = CheckpointManager(tmp_path / "c", 1)
    path = mgr.save(1, {"learner_shards": DirectoryState(lambda d: (d / "a.distcp").write_bytes(b"x"))})
    os.symlink("/etc", path / "learner_shards" / "more")
    assert mgr.problem(path) == f"{path}: learner_shards/more is a symlink (to '/etc'); refused"


@pytest.mark.parametrize("link", ["symlink", "hard link"])
def test_symlinked_lock_file_is_refused_and_its_target_kept(tmp_path, link):
    """``<run dir>/.copc.lock`` planted as a symlink to a user's file, or as a hard link of it (issue
    44 review: a regular file, so it was opened): taking the lock is refused in one line and the file
    keeps its bytes (the lock followed the link and truncated it before, or truncated the hard link)."""
    victim = tmp_path / "precious.txt"
    victim.write_text("keep me\n")
    run = tmp_path / "run"
    run.mkdir()
    (os.symlink if link == "symlink" else os.link)(victim, run / LOCK_FILE)
    with pytest.raises(ConfigError) as err:
        lock_output_dir(run)
    why = (f"is a symlink (to {str(victim)!r})" if link == "symlink"
           else "has 2 hard links (another file's name too)")
    assert str(err.value) == f"output_dir={str(run)!r}: its lock file {LOCK_FILE} {why}; refused, remove it"
    assert victim.read_text() == "keep me\n"
    os.unlink(run / LOCK_FILE)
    held = lock_output_dir(run)
    assert (run / LOCK_FILE).read_text() == f"{os.getpid()}\n"
    held.close()


def _metadata_with_save_plans(tmp_path: Path, planner_data=None) -> Path:
    """A real DCP save whose ``.metadata`` also carries every rank's ``SavePlan`` the way Megatron's
    decentralized save writes it (``global_metadata.all_local_plans``, megatron-core 0.16
    ``state_dict_saver.save_state_dict_async_plan``); the plan is torch's own planner's local plan."""
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
    from torch.distributed.checkpoint.filesystem import _StoragePrefix

    path = CheckpointManager(tmp_path / "c", 1).save(1, {"learner_shards": DirectoryState(
        lambda d: dcp.save(_state(), checkpoint_id=str(d / "dcp")))})
    planner = DefaultSavePlanner()
    planner.set_up_planner(_state(), is_coordinator=True)
    plan = planner.create_local_plan()
    plan = type(plan)(items=plan.items, storage_data=_StoragePrefix("__0_"), planner_data=planner_data)
    meta_file = path / "learner_shards" / "dcp" / ".metadata"
    md = read_dcp_metadata(meta_file)
    md.all_local_plans = [plan]
    meta_file.write_bytes(pickle.dumps(md))
    return path


def test_megatron_metadata_with_save_plans_loads(tmp_path):
    """A ``.metadata`` holding ``SavePlan`` / ``WriteItem`` / ``TensorWriteData`` / ``BytesIOWriteData``
    records (what Megatron's checkpoints carry: CI's Megatron resume test was refused before they were
    allowed) passes the check, and its tensors load."""
    path = _metadata_with_save_plans(tmp_path)
    md = read_dcp_metadata(path / "learner_shards" / "dcp" / ".metadata")
    kinds = {type(item.tensor_data if item.tensor_data is not None else item).__name__
             for item in md.all_local_plans[0].items}
    assert kinds == {"TensorWriteData", "WriteItem"}  # tensor items and bytes items
    assert check_dcp_tree(path / "learner_shards") == 1
    target = {"actor": {"w": torch.zeros(3, 4)},
              "actor_opt": {"param_groups": [{"lr": 0.0, "betas": (0.0, 0.0), "params": ["x"]}]}}
    safe_dcp_load(target, path / "learner_shards" / "dcp")
    assert torch.equal(target["actor"]["w"], torch.arange(12.0).reshape(3, 4))


def test_code_inside_a_save_plan_is_still_refused(tmp_path):
    """The plan's fields go through the same allowlist: a pickle in its ``planner_data`` is refused
    and never runs."""
    pwned = tmp_path / "pwned"
    path = _metadata_with_save_plans(tmp_path, planner_data={"x": _WritesMarker(pwned)})
    with pytest.raises(UnsafeCheckpointError, match=r"it would call builtins\.exec when unpickled"):
        check_dcp_tree(path / "learner_shards")
    assert not pwned.exists()
