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
* :class:`SafeDCPReader` (a ``FileSystemReader`` using it) and :class:`SafeLoadPlanner` (non-tensor values
  through ``torch.load(weights_only=True)``) are what :func:`safe_dcp_load` passes to ``dcp.load``.

Errors are :class:`UnsafeCheckpointError`, one line naming the file and what was refused.
"""

from __future__ import annotations

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
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import FileSystemReader, _metadata_fn, _StorageInfo
from torch.distributed.checkpoint.planner import ReadItem

from ...errors import ConfigError

#: (module, name) pairs a DCP ``.metadata`` pickle may construct; torch dtypes are allowed separately.
_ALLOWED = {
    **{("torch.distributed.checkpoint.metadata", n): getattr(dcp_md, n) for n in (
        "Metadata", "MetadataIndex", "TensorStorageMetadata", "TensorProperties", "ChunkStorageMetadata",
        "BytesStorageMetadata", "StorageMeta", "_MEM_FORMAT_ENCODING")},
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"): _StorageInfo,
    ("torch", "Size"): torch.Size,
    ("torch.serialization", "_get_layout"): torch.serialization._get_layout,
    ("torch._utils", "_get_layout"): torch.serialization._get_layout,
    ("pathlib", "PosixPath"): pathlib.PosixPath,
    ("pathlib", "PurePosixPath"): pathlib.PurePosixPath,
}


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
        try:
            obj = torch.load(value, weights_only=True)
        except pickle.UnpicklingError as e:
            raise UnsafeCheckpointError(f"DCP value {read_item.dest_index.fqn!r}: refused, not plain data "
                                        f"({str(e).splitlines()[0]})") from None
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
    """Check, before any rank loads it, every DCP ``.metadata`` file under ``directory`` (the sharded
    learner state of a checkpoint) with :func:`read_dcp_metadata`, and that no symlink sits there.

    Returns:
        How many ``.metadata`` files were checked.

    Raises:
        UnsafeCheckpointError: a symlink, or a metadata file that would run code or names a file
            outside its directory (one line naming it).
    """
    n = 0
    for root, dirs, names in os.walk(directory):
        for name in [*dirs, *names]:
            if os.path.islink(os.path.join(root, name)):
                raise UnsafeCheckpointError(f"{Path(root, name)}: is a symlink inside the sharded learner "
                                            "state; refused")
        for name in names:
            if name.endswith(".metadata"):
                read_dcp_metadata(Path(root, name))
                n += 1
    return n
