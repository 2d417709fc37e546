"""Issue 44 item 3 follow-up: the driver's check reads every non-tensor DCP item, not only ``.metadata``.

Megatron's ``dist_checkpointing.load`` reads with torch's stock ``FileSystemReader`` and a planner
(``MCoreLoadPlanner``) that inherits ``load_bytes`` → ``torch.load(weights_only=False)``, so a genuine
``.metadata`` with a pickle planted in a ``.distcp`` ``BYTES`` item passed the check and ran code in the
ranks. Real files: a ``dcp.save`` checkpoint (stock DCP, as Megatron's ``torch_dist`` format writes it,
``ShardedObject`` data as ``io.BytesIO`` of ``torch.save``) whose item bytes are overwritten in place.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import pathlib
import random
import types
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

from trainer.learner.distributed.safe_dcp import (
    MEGATRON_COMMON,
    SafeDCPReader,
    SafeLoadPlanner,
    UnsafeCheckpointError,
    check_dcp_tree,
    check_dcp_values,
    load_plain_value,
    read_dcp_metadata,
    safe_dcp_load,
)

from .test_untrusted_checkpoint import _WritesMarker


def _saved(obj, legacy: bool = False) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf, _use_new_zipfile_serialization=not legacy)
    return buf.getvalue()


class _RawBytesSavePlanner(DefaultSavePlanner):
    """Writes ``io.BytesIO`` values' bytes as they are (Megatron's ``MCoreSavePlanner.transform_object``:
    a ``ShardedObject`` arrives as ``torch.save([data])`` in a ``BytesIO``, loaded back as ``[data]``)."""

    def transform_object(self, write_item, object):
        return object if isinstance(object, io.BytesIO) else super().transform_object(write_item, object)


def _save(state: dict, directory: Path) -> None:
    dcp.save(state, checkpoint_id=str(directory), planner=_RawBytesSavePlanner())


def _megatron_rng_state() -> list[dict]:
    """What Megatron's ``get_rng_state`` puts in its ``rng_state`` ``ShardedObject`` (CPU stand-ins)."""
    return [{"random_rng_state": random.getstate(), "np_rng_state": np.random.get_state(),
             "torch_rng_state": torch.get_rng_state(), "cuda_rng_state": torch.get_rng_state(),
             "rng_tracker_states": {"model-parallel-rng": torch.get_rng_state()}}]


#: A Transformer Engine module's legacy extra state: a ``ShardedObject`` of an ``io.BytesIO`` that TE
#: ``torch.load``-s again in ``set_extra_state``.
_TE = "decoder.layers.self_attention.linear_proj._extra_state/shard_0_1"


def _lambda_lr_state() -> dict:
    """The megatron backend's ``LambdaLR`` warm-up state (in its common state)."""
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.5)
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda i: min(1.0, (i + 1) / 4)).state_dict()


def _state() -> dict:
    """A learner state as Megatron's ``torch_dist`` strategy hands it to DCP: tensors, and each
    ``ShardedObject`` as an ``io.BytesIO`` of ``torch.save([data])``; plus nested plain values."""
    common = {"optimizer": {"param_groups": [{"lr": 0.5, "betas": (0.9, 0.99), "params": [0, 1],
                                              "default_config": True, "min_lr": None}]},
              "scheduler": _lambda_lr_state(), "common_step": 2.0}
    return {"model": {"w": torch.arange(6.0)},
            "common_state/shard_0_1": io.BytesIO(_saved([common])),
            "rng_state/shard_0.0_1.1": io.BytesIO(_saved(_megatron_rng_state())),
            _TE: io.BytesIO(_saved([io.BytesIO(_saved({"scale": torch.ones(2)}))])),
            "extra": {"path": pathlib.PosixPath("/x/y"),
                      "ns": types.SimpleNamespace(a=1), "args": argparse.Namespace(seed=7),
                      "pad": "x" * 4000}}


def _bytes_item(directory: Path, fqn: str):
    md = read_dcp_metadata(directory / ".metadata")
    return next(v for k, v in md.storage_data.items() if k.fqn == fqn)


def _plant(directory: Path, fqn: str, payload: bytes) -> Path:
    """Overwrite item ``fqn``'s bytes in its ``.distcp`` file in place (``.metadata`` untouched)."""
    info = _bytes_item(directory, fqn)
    assert len(payload) <= info.length, (len(payload), info.length)
    data_file = directory / info.relative_path
    with open(data_file, "r+b") as fh:
        fh.seek(info.offset)
        fh.write(payload + b"\0" * (info.length - len(payload)))
    return data_file


def test_genuine_megatron_style_values_pass_and_round_trip(tmp_path):
    """Numpy and Python RNG state, torch RNG tensors, Megatron's common state, ``io.BytesIO``, paths and
    namespaces pass the check (every non-tensor item loaded), and load back equal."""
    ck = tmp_path / "shards" / "actor"
    _save(_state(), ck)
    assert check_dcp_tree(tmp_path / "shards") == 1
    md = read_dcp_metadata(ck / ".metadata")
    n_values = sum(isinstance(m, type(md.state_dict_metadata["extra.pad"]))
                   for m in md.state_dict_metadata.values())
    assert check_dcp_values(ck / ".metadata") == n_values == 7  # 3 ShardedObjects, 4 plain values
    target = {k: io.BytesIO() for k in ("common_state/shard_0_1", "rng_state/shard_0.0_1.1", _TE)}
    dcp.load(target, storage_reader=SafeDCPReader(ck), planner=SafeLoadPlanner(flatten_state_dict=False,
                                                                       flatten_sharded_tensors=False))
    rng = target["rng_state/shard_0.0_1.1"][0]  # what Megatron's planner (flatten_state_dict=False) gets
    want = _megatron_rng_state()[0]
    assert rng["random_rng_state"] == want["random_rng_state"]
    assert all(np.array_equal(a, b) for a, b in zip(rng["np_rng_state"], want["np_rng_state"], strict=True))
    assert torch.equal(rng["torch_rng_state"], want["torch_rng_state"])
    assert target["common_state/shard_0_1"][0]["common_step"] == 2.0
    assert target["common_state/shard_0_1"][0]["scheduler"] == _lambda_lr_state()
    assert torch.equal(rng["rng_tracker_states"]["model-parallel-rng"], want["torch_rng_state"])
    inner = torch.load(target[_TE][0], weights_only=True)
    assert torch.equal(inner["scale"], torch.ones(2))
    target = {**_state(), "model": {"w": torch.zeros(6)}}
    safe_dcp_load(target, ck)
    assert target["extra"]["args"] == argparse.Namespace(seed=7)
    assert target["extra"]["path"] == pathlib.PosixPath("/x/y") and target["extra"]["ns"].a == 1
    assert torch.equal(target["model"]["w"], torch.arange(6.0))


@pytest.mark.parametrize("where", ["distcp item", "io.BytesIO in an item", "common.pt"])
def test_pickle_planted_in_a_value_is_refused_before_it_runs(tmp_path, where):
    """A genuine checkpoint whose ``rng_state`` item (``.metadata`` left genuine), or Megatron's
    ``common.pt``, holds a pickle that writes a marker: the driver's check refuses it in one line
    naming the file and item, and the marker is never written. The stock planner (Megatron's
    ``load_bytes``) runs the same bytes (the exploit is real)."""
    pwned = tmp_path / "pwned"
    shards = tmp_path / "shards"
    ck = shards / "actor"
    _save(_state(), ck)
    evil = _saved(_WritesMarker(pwned), legacy=where != "common.pt")  # legacy: fits in place
    if where == "common.pt":
        (ck / MEGATRON_COMMON).write_bytes(evil)
        expected = f"{ck / MEGATRON_COMMON}: refused, not plain data ("
    elif where == "io.BytesIO in an item":
        data_file = _plant(ck, _TE, _saved([io.BytesIO(evil)], legacy=True))
        expected = f"{data_file}: DCP value {_TE!r} (inner io.BytesIO): refused, not plain data ("
    else:
        data_file = _plant(ck, "rng_state/shard_0.0_1.1", evil)
        expected = f"{data_file}: DCP value 'rng_state/shard_0.0_1.1': refused, not plain data ("
    with pytest.raises(UnsafeCheckpointError) as err:
        check_dcp_tree(shards)
    msg = str(err.value)
    assert msg.startswith(expected) and len(msg.splitlines()) == 1, msg
    assert msg.endswith("(Unsupported global: GLOBAL exec was not an allowed global by default.)"), msg
    assert not pwned.exists()
    if where == "distcp item":
        with contextlib.suppress(CheckpointException):
            dcp.load(_state(), checkpoint_id=str(ck))
        assert pwned.read_text() == "pwned"


def test_item_pointing_past_its_data_file_is_refused(tmp_path):
    """A ``.metadata`` whose non-tensor record reaches past the end of its data file is refused
    naming it (the check reads exactly the bytes a rank would)."""
    ck = tmp_path / "actor"
    _save(_state(), ck)
    md = read_dcp_metadata(ck / ".metadata")
    info = next(v for k, v in md.storage_data.items() if k.fqn == "extra.pad")
    info.offset = (ck / info.relative_path).stat().st_size
    (ck / ".metadata").write_bytes(__import__("pickle").dumps(md))
    with pytest.raises(UnsafeCheckpointError, match=r"lies outside its data file"):
        check_dcp_tree(tmp_path)


def test_numpy_1_pickle_names_pass():
    """RNG state pickled under numpy 1.x (``numpy.core.multiarray._reconstruct``, as a GPU box with an
    older numpy writes it) loads equal; the same bytes naming another numpy function are refused."""
    state = np.random.get_state()
    data = _saved(state, legacy=True)
    assert data.count(b"numpy._core.multiarray\n_reconstruct\n") == 1  # numpy 2 here
    old = data.replace(b"numpy._core.multiarray\n", b"numpy.core.multiarray\n")
    value = load_plain_value(old, "rng")
    assert value[0] == "MT19937" and np.array_equal(value[1], state[1]) and value[2:] == state[2:]
    other = data.replace(b"numpy._core.multiarray\n_reconstruct\n", b"numpy\nload\n")
    with pytest.raises(UnsafeCheckpointError, match=r"^rng: refused, not plain data \(.*numpy\.load"):
        load_plain_value(other, "rng")
