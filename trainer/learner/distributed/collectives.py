"""Object collectives on a gloo group that a rank may leave the process right after.

``torch.distributed.broadcast_object_list`` / ``all_gather_object`` pickle into tensors that the
call creates and drops. The gloo worker thread that ran the collective drops its own reference
to them only *after* the waiting thread woke, so it may hold the last one. If the interpreter is
finalizing by then (a rank exits right after its last collective: the ``shutdown`` command, or
the error report before a failed rank leaves), the worker's GIL acquire ends the thread with
``pthread_exit`` inside a C++ destructor: ``terminate called without an active exception``,
SIGABRT. ``copc train`` under torchrun failed that way in about 1 of 3 runs (the race of
pytorch/pytorch PR #179291). The versions here keep their buffers until gloo let go of them
(:func:`wait_released`), so the last reference is always Python's.

The groups must be gloo (CPU tensors): the ranks' ``cpu_group`` / ``dp_gloo``.
"""

from __future__ import annotations

import pickle
import time
from typing import Any

import torch
import torch.distributed as dist


def wait_released(*tensors: torch.Tensor, timeout_s: float = 10.0) -> bool:
    """Wait until the caller holds the only reference to each tensor (``Tensor._use_count() == 1``).

    Args:
        tensors: tensors of a finished collective, still referenced by the caller.
        timeout_s: give up after this many seconds (returns False; nothing is raised).

    Returns:
        True once every tensor is released by the collective's worker thread; False after the
        timeout, or at once when this torch has no ``Tensor._use_count`` (a private API).
    """
    if not hasattr(torch.Tensor, "_use_count"):
        return False
    deadline = time.monotonic() + timeout_s
    while any(t._use_count() > 1 for t in tensors):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.0005)
    return True


def _as_bytes(obj: Any) -> torch.Tensor:
    """``obj`` pickled, as a ``(n,)`` uint8 tensor (n bytes)."""
    return torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)


def broadcast_object(obj: Any, group: Any, src: int = 0) -> Any:
    """Global rank ``src``'s ``obj`` on every rank of ``group``: its pickle's length (one int64),
    then its bytes; returns once gloo released both buffers.

    Args:
        obj: any picklable object on ``src``; ignored elsewhere.
        group: a gloo process group. src: the sending global rank.

    Returns:
        ``obj`` on ``src``, an unpickled copy elsewhere.

    Raises:
        pickle.PicklingError / TypeError (on ``src``, before any collective): ``obj`` does not
            pickle. RuntimeError (gloo): a peer left or the group's timeout passed.
            pickle.UnpicklingError and friends (not on ``src``): the bytes do not unpickle here
            (e.g. a class this process cannot import).
    """
    is_src = dist.get_rank() == src
    payload = _as_bytes(obj) if is_src else None
    size = torch.tensor([payload.numel() if payload is not None else 0], dtype=torch.int64)
    dist.broadcast(size, src=src, group=group)
    buf = payload if payload is not None else torch.empty(int(size.item()), dtype=torch.uint8)
    dist.broadcast(buf, src=src, group=group)
    wait_released(size, buf)
    return obj if is_src else pickle.loads(buf.numpy().tobytes())


def all_gather_objects(obj: Any, group: Any) -> list[Any]:
    """``[obj of group rank 0, obj of group rank 1, …]``: every rank's pickle length, then the
    pickles padded to the longest; returns once gloo released every buffer.

    Args:
        obj: any picklable object (small: every rank receives every rank's bytes).
        group: a gloo process group.

    Returns:
        One unpickled object per rank of ``group``, in group-rank order (this rank's own too).

    Raises:
        As :func:`broadcast_object` (pickling before any collective; gloo RuntimeError).
    """
    world = dist.get_world_size(group)
    mine = _as_bytes(obj)
    size = torch.tensor([mine.numel()], dtype=torch.int64)
    sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
    dist.all_gather(sizes, size, group=group)
    longest = max(int(s.item()) for s in sizes)
    padded = torch.zeros(longest, dtype=torch.uint8)
    padded[:mine.numel()] = mine
    bufs = [torch.empty(longest, dtype=torch.uint8) for _ in range(world)]
    dist.all_gather(bufs, padded, group=group)
    wait_released(size, *sizes, padded, *bufs)
    return [pickle.loads(b[:int(s.item())].numpy().tobytes()) for b, s in zip(bufs, sizes, strict=True)]


__all__ = ["all_gather_objects", "broadcast_object", "wait_released"]
