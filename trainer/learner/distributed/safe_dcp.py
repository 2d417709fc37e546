"""Reading a ``torch.distributed.checkpoint`` (DCP) directory without running code from it.

A DCP checkpoint is a ``.metadata`` file (a pickle of DCP's ``Metadata``) and ``*.distcp`` data
files. Stock ``dcp.load`` unpickles ``.metadata`` with ``pickle.load`` and every
non-tensor value (optimizer ``param_groups`` entries, ...) with ``torch.load(weights_only=False)``, so a
crafted checkpoint runs arbitrary code on load, and its ``storage_data`` may name data files anywhere
(``../../x``). Here:

* :func:`read_dcp_metadata` unpickles ``.metadata`` with an allowlist of the constructors DCP's metadata
  is made of (its dataclasses, ``torch.Size``, torch dtypes and layouts, ``pathlib`` paths): any other
  global (``os.system``, ``builtins.exec``, ...) is refused before it is called (the "restricting
  globals" recipe of the :mod:`pickle` docs). It then checks the shape and that every data file it names
  is a plain file name inside the checkpoint directory, not a symlink.
* :func:`load_plain_value` reads one non-tensor value (a DCP ``BYTES`` item: optimizer ``param_groups``
  entries, Megatron ``ShardedObject`` data such as its common state or RNG state) with
  ``torch.load(weights_only=True)`` and :data:`VALUE_GLOBALS`, nothing else.
* :class:`SafeDCPReader` (a ``FileSystemReader`` using it) and :class:`SafeLoadPlanner` (non-tensor values
  through :func:`load_plain_value`) are what :func:`safe_dcp_load` passes to ``dcp.load``.
* :func:`check_dcp_tree` is the driver's check before any rank reads a sharded checkpoint, also for
  loaders that use the stock reader and planner (Megatron's ``dist_checkpointing.load``, whose
  ``MCoreLoadPlanner`` unpickles ``BYTES`` items with ``weights_only=False``): every ``.metadata``, every
  non-tensor item it lists (read from its ``.distcp`` file and loaded by :func:`load_plain_value`), and
  Megatron's legacy ``common.pt``. Files rewritten between this check and the ranks' load are not
  covered (time of check, time of use).

Errors are :class:`UnsafeCheckpointError`, one line naming the file and what was refused.
"""

from __future__ import annotations

import contextlib
import importlib
import io
import os
import pathlib
import pickle
import stat
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import metadata as dcp_md
from torch.distributed.checkpoint import planner as dcp_planner
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import (
    FileSystemReader,
    _metadata_fn,
    _StorageInfo,
    _StoragePrefix,
)
from torch.distributed.checkpoint.planner import ReadItem

from ...errors import ConfigError

#: (module, name) pairs a DCP ``.metadata`` pickle may construct; torch dtypes are allowed separately.
_ALLOWED = {
    **{("torch.distributed.checkpoint.metadata", n): getattr(dcp_md, n) for n in (
        "Metadata", "MetadataIndex", "TensorStorageMetadata", "TensorProperties", "ChunkStorageMetadata",
        "BytesStorageMetadata", "StorageMeta", "_MEM_FORMAT_ENCODING")},
    # Megatron's decentralized save plan stores every rank's SavePlan in the metadata
    # (state_dict_saver.save_state_dict_async_plan: ``global_metadata.all_local_plans``): plain
    # dataclasses and enums of torch's planner, whose fields go through this same unpickler.
    **{("torch.distributed.checkpoint.planner", n): getattr(dcp_planner, n) for n in (
        "SavePlan", "WriteItem", "WriteItemType", "TensorWriteData", "BytesIOWriteData")},
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"): _StorageInfo,
    ("torch.distributed.checkpoint.filesystem", "_StoragePrefix"): _StoragePrefix,
    ("torch", "Size"): torch.Size,
    ("torch.serialization", "_get_layout"): torch.serialization._get_layout,
    ("torch._utils", "_get_layout"): torch.serialization._get_layout,
    ("pathlib", "PosixPath"): pathlib.PosixPath,
    ("pathlib", "PurePosixPath"): pathlib.PurePosixPath,
}


#: What a non-tensor DCP value may construct beyond ``torch.load(weights_only=True)``'s own allowlist
#: (tensors, ``torch.Size``, dtypes, builtin scalars and containers, ``OrderedDict``): the classes
#: megatron-core 0.16 registers for its checkpoints (``megatron/core/safe_globals.py``) that are not
#: Megatron's own — numpy arrays (``np.random.get_state()`` of an RNG ``ShardedObject``; numpy 1 pickles
#: name ``numpy.core.multiarray._reconstruct``, also allowed), ``io.BytesIO`` (Transformer Engine's legacy
#: extra state), ``PosixPath``, ``SimpleNamespace``, ``argparse.Namespace``, ``signal.Signals``. Python's
#: ``random.getstate()`` and torch RNG tensors are plain tuples and tensors. Megatron's own classes
#: (``OptimizerConfig``, rerun-state enums: what its training loop saves, not COPC's learners) are refused.
VALUE_GLOBALS = ("numpy._core.multiarray._reconstruct", "numpy.ndarray", "numpy.dtype",
                 "numpy.dtypes.UInt32DType", "_io.BytesIO", "pathlib.PosixPath", "types.SimpleNamespace",
                 "argparse.Namespace", "signal.Signals")


def _value_globals() -> list[tuple[Any, str]]:
    """``(object, pickled name)`` for each of :data:`VALUE_GLOBALS` this numpy has."""
    out = []
    for name in VALUE_GLOBALS:
        module, _, attr = name.rpartition(".")
        for mod in (module, module.replace("numpy._core", "numpy.core")):  # numpy 1.x: numpy.core only
            with contextlib.suppress(ImportError, AttributeError):
                out.append((getattr(importlib.import_module(mod), attr), name))
                break
    reconstruct = next((obj for obj, n in out if n == VALUE_GLOBALS[0]), None)
    return out + ([(reconstruct, "numpy.core.multiarray._reconstruct")] if reconstruct else [])


#: Megatron ``dist_checkpointing``'s legacy file of the non-sharded state, beside its ``.metadata``.
MEGATRON_COMMON = "common.pt"


class UnsafeCheckpointError(ConfigError):
    """A DCP checkpoint file that would run code, or names a file outside its directory (one line;
    a :class:`~trainer.errors.ConfigError`, so the CLI exits 2 with it)."""


class _MetadataUnpickler(pickle.Unpickler):
    """``pickle.Unpickler`` that resolves only the globals of :data:`_ALLOWED` and torch dtypes."""

    def __init__(self, fh: Any, source: Path) -> None:
        super().__init__(fh)
        self.source = source

    def find_class(self, module: str, name: str) -> Any:
        """The allowed global ``module.name``.

        Raises:
            UnsafeCheckpointError: any other global (it is never imported nor called).
        """
        if (module, name) in _ALLOWED:
            return _ALLOWED[(module, name)]
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise UnsafeCheckpointError(f"{self.source}: refused, it would call {module}.{name} when unpickled "
                                    "(not DCP metadata; a crafted checkpoint?)")


def _check_data_file(directory: Path, rel: Any, source: Path) -> None:
    """Refuse a ``storage_data`` file name that is not a plain regular file directly in ``directory``."""
    if (not isinstance(rel, str) or not rel or "/" in rel or "\\" in rel or rel in (".", "..")
            or "\0" in rel):
        raise UnsafeCheckpointError(f"{source}: data file {rel!r} is not a file name inside {directory}")
    try:
        mode = os.lstat(directory / rel).st_mode
    except FileNotFoundError:
        raise UnsafeCheckpointError(f"{source}: data file {rel!r} is missing from {directory}") from None
    if not stat.S_ISREG(mode):
        raise UnsafeCheckpointError(f"{source}: data file {rel!r} is a symlink or not a regular file")


def read_dcp_metadata(path: str | Path) -> dcp_md.Metadata:
    """The ``Metadata`` of a DCP ``.metadata`` file, read without running code from it.

    Args:
        path: the ``.metadata`` file (its directory holds the data files it names).

    Returns:
        The metadata; every ``storage_data`` entry names a regular file directly beside ``path``.

    Raises:
        UnsafeCheckpointError: a global outside the allowlist, another shape than DCP's
            ``Metadata``, a data file name with a ``/`` or ``..``, a missing or symlinked data file
            (one line naming ``path``).
        OSError: ``path`` cannot be read.
    """
    path = Path(path)
    if path.is_symlink():
        raise UnsafeCheckpointError(f"{path}: is a symlink; refused")
    with open(path, "rb") as fh:
        try:
            md = _MetadataUnpickler(fh, path).load()
        except UnsafeCheckpointError:
            raise
        except Exception as e:  # any malformed pickle is one refused file
            raise UnsafeCheckpointError(
                f"{path}: not readable as DCP metadata ({type(e).__name__}: {e})") from None
    if not isinstance(md, dcp_md.Metadata) or not isinstance(md.storage_data, dict) or not all(
            isinstance(v, _StorageInfo) for v in md.storage_data.values()):
        raise UnsafeCheckpointError(f"{path}: not DCP metadata (a Metadata with _StorageInfo records)")
    for info in md.storage_data.values():
        _check_data_file(path.parent, info.relative_path, path)
        if info.transform_descriptors:
            raise UnsafeCheckpointError(f"{path}: stream transforms {info.transform_descriptors!r} "
                                        "are not supported")
    return md


def load_plain_value(data: bytes, where: str) -> Any:
    """One non-tensor value as ``torch.save`` wrote it, loaded without running code from it:
    ``torch.load(weights_only=True, map_location="cpu")`` with :data:`VALUE_GLOBALS` added for this
    call only. An ``io.BytesIO`` inside the value (Transformer Engine's legacy extra state, which it
    ``torch.load``-s again) must itself hold such a value.

    Args:
        data: the value's bytes. where: names it in the error (file and item).

    Returns:
        The value (tensors on the CPU).

    Raises:
        UnsafeCheckpointError: any other global, a TorchScript archive, or bytes that are not a
            ``torch.save`` file (one line: ``where`` and the reason).
    """
    extra = getattr(torch.serialization, "safe_globals", None)  # torch >= 2.5; before: torch's own only
    with extra(_value_globals()) if extra else contextlib.nullcontext():
        try:
            value = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
        except Exception as e:  # whatever it is, the value is not plain data
            raise UnsafeCheckpointError(f"{where}: refused, not plain data ({_reason(e)})") from None
    _check_nested_bytes(value, where)
    return value


def _reason(e: Exception) -> str:
    """The line of a ``torch.load`` error that says what was refused (torch's is many lines long)."""
    lines = [ln.strip().removeprefix("WeightsUnpickler error: ") for ln in str(e).splitlines() if ln.strip()]
    named = [ln for ln in lines if "GLOBAL" in ln] or [
        ln for ln in lines if not ln.startswith("Weights only")]
    return (named or lines or [type(e).__name__])[0].split(". ")[0].rstrip(".") + "."


def _check_nested_bytes(value: Any, where: str, depth: int = 0) -> None:
    """:func:`load_plain_value` on every ``io.BytesIO`` inside ``value`` (dicts, lists, tuples)."""
    if depth > 64:
        raise UnsafeCheckpointError(f"{where}: refused, nested deeper than 64 levels")
    if isinstance(value, io.BytesIO):
        load_plain_value(value.getvalue(), f"{where} (inner io.BytesIO)")
    elif isinstance(value, dict):
        for v in value.values():
            _check_nested_bytes(v, where, depth + 1)
    elif isinstance(value, (list, tuple)):
        for v in value:
            _check_nested_bytes(v, where, depth + 1)


def _read_item(directory: Path, info: _StorageInfo, source: Path) -> bytes:
    """The bytes ``info`` names in its data file (checked by :func:`read_dcp_metadata`)."""
    ok = all(type(v) is int and v >= 0 for v in (info.offset, info.length))
    if ok:
        fd = os.open(directory / info.relative_path, os.O_RDONLY | os.O_NOFOLLOW)
        with os.fdopen(fd, "rb") as fh:
            fh.seek(info.offset)
            data = fh.read(info.length)
    if not ok or len(data) != info.length:
        raise UnsafeCheckpointError(f"{source}: item at {info.relative_path}[{info.offset}:+{info.length}] "
                                    "lies outside its data file")
    return data


def check_dcp_values(path: str | Path, md: dcp_md.Metadata | None = None) -> int:
    """Load every non-tensor item the ``.metadata`` file ``path`` lists (a ``BYTES`` entry, or a record
    without a tensor entry) from its data file with :func:`load_plain_value`, one at a time.

    Args:
        path: the ``.metadata`` file. md: its metadata when already read by :func:`read_dcp_metadata`.

    Returns:
        How many items were loaded (peak memory: the largest one).

    Raises:
        UnsafeCheckpointError: an item that is not plain data or lies outside its file (one line
            naming the data file and the item's key).
    """
    path = Path(path)
    md = read_dcp_metadata(path) if md is None else md
    n = 0
    for index, info in md.storage_data.items():
        if isinstance(md.state_dict_metadata.get(index.fqn), dcp_md.TensorStorageMetadata):
            continue  # tensors are read with weights_only=True by every FileSystemReader
        load_plain_value(_read_item(path.parent, info, path),
                         f"{path.parent / info.relative_path}: DCP value {index.fqn!r}")
        n += 1
    return n


class SafeDCPReader(FileSystemReader):
    """``FileSystemReader`` whose metadata comes from :func:`read_dcp_metadata` (tensors are read by
    the parent with ``torch.load(weights_only=True)``)."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> dcp_md.Metadata:
        """The checkpoint's metadata, read safely (``rank`` as the parent's keyword).

        Raises:
            UnsafeCheckpointError: see :func:`read_dcp_metadata`.
        """
        md = read_dcp_metadata(self._get_metadata_path(kwargs.get("rank")))
        if md.storage_meta is None:
            md.storage_meta = dcp_md.StorageMeta()
        md.storage_meta.load_id = self.load_id
        return md


class SafeLoadPlanner(DefaultLoadPlanner):
    """``DefaultLoadPlanner`` reading non-tensor values with ``torch.load(weights_only=True)`` (the stock
    planner uses ``weights_only=False``)."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        """Store the plain value ``value`` holds at ``read_item``'s key.

        Raises:
            UnsafeCheckpointError: the value is not plain data (it would run code when unpickled).
        """
        obj = load_plain_value(value.read(), f"DCP value {read_item.dest_index.fqn!r}")
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj


def safe_dcp_load(state: dict[str, Any], directory: str | Path) -> None:
    """``dcp.load(state, checkpoint_id=directory)`` (in place, collective like it) through
    :class:`SafeDCPReader` and :class:`SafeLoadPlanner`.

    Raises:
        UnsafeCheckpointError: the checkpoint would run code or names a file outside ``directory``
            (one line, also when DCP itself caught it: unwrapped from its ``CheckpointException``).
    """
    directory = Path(directory)
    if directory.is_symlink():
        raise UnsafeCheckpointError(f"{directory}: is a symlink; refused")
    read_dcp_metadata(directory / _metadata_fn)  # one clear line here: dcp.load would wrap the error
    try:
        dcp.load(state, storage_reader=SafeDCPReader(directory), planner=SafeLoadPlanner())
    except CheckpointException as e:
        refused = [exc for exc, _trace in e.failures.values() if isinstance(exc, UnsafeCheckpointError)]
        if refused:
            raise refused[0] from None
        raise


def check_dcp_tree(directory: str | Path) -> int:
    """Check, before any rank loads it, the sharded learner state of a checkpoint under ``directory``:
    no symlink sits there; every DCP ``.metadata`` file passes :func:`read_dcp_metadata`, and every
    non-tensor item it lists passes :func:`check_dcp_values` (what Megatron's loader would unpickle
    with ``weights_only=False``); a Megatron ``common.pt`` beside a ``.metadata`` passes
    :func:`load_plain_value` (its loader uses torch's default, ``weights_only=False`` before torch 2.6).

    Returns:
        How many ``.metadata`` files were checked.

    Raises:
        UnsafeCheckpointError: a symlink, a metadata file that would run code or names a file outside
            its directory, or a value that is not plain data (one line naming the file and item).
    """
    n = 0
    for root, dirs, names in os.walk(directory):
        for name in [*dirs, *names]:
            if os.path.islink(os.path.join(root, name)):
                raise UnsafeCheckpointError(f"{Path(root, name)}: is a symlink inside the sharded learner "
                                            "state; refused")
        for name in names:
            if name.endswith(".metadata"):
                check_dcp_values(Path(root, name), read_dcp_metadata(Path(root, name)))
                n += 1
        if MEGATRON_COMMON in names and any(name.endswith(".metadata") for name in names):
            load_plain_value(Path(root, MEGATRON_COMMON).read_bytes(), str(Path(root, MEGATRON_COMMON)))
    return n
