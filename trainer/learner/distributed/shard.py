"""Data-parallel helpers shared by the distributed backends: row split, micro-batch plan with
equal pass counts, batch placement, row gathers, training-state bytes.

Why each exists:

* FSDP and Megatron's data parallel run collectives inside every forward/backward, so every
  data-parallel rank must run the SAME number of micro-batch passes even when its share of a
  mini-batch is smaller (:func:`micro_plan` pads with zero-weight passes).
* The loss of a micro-batch is normalised by counts of the WHOLE mini-batch (every rank holds
  it: :meth:`~trainer.learner.algorithm.ActorCriticAlgorithm.denominators`, spec §aggregation:
  micro-batch losses sum to the mini-batch loss), so the rank gradients, summed by the
  data-parallel reduction, equal the single-process gradient.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch
import torch.distributed as dist

from ...rollout.batch import RolloutBatch

Tensor = torch.Tensor


def dp_rows(n_rows: int, dp_rank: int, dp_size: int) -> slice:
    """The contiguous rows of a ``n_rows``-row (mini-)batch owned by data-parallel rank ``dp_rank``.

    The first ``n_rows % dp_size`` ranks get ``⌈n_rows / dp_size⌉`` rows, the others
    ``⌊n_rows / dp_size⌋`` (possibly 0); the slices tile ``range(n_rows)`` in rank order.

    Raises:
        ValueError: ``dp_size < 1``, ``dp_rank`` not in ``[0, dp_size)`` or ``n_rows < 0``.
    """
    if dp_size < 1 or not 0 <= dp_rank < dp_size or n_rows < 0:
        raise ValueError(f"dp_rows: need n_rows >= 0 and 0 <= dp_rank < dp_size, got n_rows={n_rows}, "
                         f"dp_rank={dp_rank}, dp_size={dp_size}")
    base, extra = divmod(n_rows, dp_size)
    start = dp_rank * base + min(dp_rank, extra)
    return slice(start, start + base + (1 if dp_rank < extra else 0))


def micro_plan(n_rows: int, dp_rank: int, dp_size: int, micro_batch_size: int) -> list[slice | None]:
    """This rank's micro-batch row slices of an ``n_rows``-row mini-batch, padded to a common count.

    Every rank gets ``⌈⌈n_rows / dp_size⌉ / micro_batch_size⌉`` entries (at least 1): slices
    (relative to the mini-batch) over its :func:`dp_rows` rows, ``micro_batch_size`` rows each,
    then ``None`` for a padding pass (the caller runs a zero-weight forward/backward so the
    collectives of every rank line up).

    Raises:
        ValueError: as :func:`dp_rows`, or ``micro_batch_size < 1``.
    """
    if micro_batch_size < 1:
        raise ValueError(f"micro_batch_size={micro_batch_size}: must be >= 1")
    own = dp_rows(n_rows, dp_rank, dp_size)
    n_pass = max(1, math.ceil(math.ceil(n_rows / dp_size) / micro_batch_size))
    slices: list[slice | None] = [slice(i, min(i + micro_batch_size, own.stop))
                                  for i in range(own.start, own.stop, micro_batch_size)]
    return slices + [None] * (n_pass - len(slices))


def batch_to(b: RolloutBatch, device: torch.device) -> RolloutBatch:
    """``b`` with every tensor on ``device`` (``b`` itself when already there)."""
    if b.input_ids.device == device:
        return b
    return dataclasses.replace(b, **{f.name: getattr(b, f.name).to(device) for f in dataclasses.fields(b)
                                     if isinstance(getattr(b, f.name), Tensor)})


def gather_rows(local: Tensor, n_rows: int, dp_rank: int, dp_size: int, group: Any = None) -> Tensor:
    """Concatenate each data-parallel rank's :func:`dp_rows` block of a ``(B, …)`` tensor.

    Args:
        local: ``(rows of this rank, …)``; same trailing shape and dtype on every rank.
        n_rows: ``B`` of the whole batch.
        group: the data-parallel group (None: the world, when it is the data-parallel group).

    Returns:
        ``(n_rows, …)``, rows in rank order (= the original row order). Collective.
    """
    width = math.ceil(n_rows / dp_size)
    padded = local.new_zeros((width, *local.shape[1:]))
    padded[: local.shape[0]] = local
    parts = [torch.empty_like(padded) for _ in range(dp_size)]
    dist.all_gather(parts, padded.contiguous(), group=group)
    return torch.cat([p[: dp_rows(n_rows, r, dp_size).stop - dp_rows(n_rows, r, dp_size).start]
                      for r, p in enumerate(parts)])


def training_state_bytes(models: list[Any], optimizers: list[Any]) -> dict[str, int]:
    """Bytes of the distinct tensor storages behind ``models``' parameters and gradients and
    ``optimizers``' state, in this process (a DTensor counts its local shard's storage).

    Each storage is counted once (tied weights, views); its full ``nbytes`` is counted, so the
    padding FSDP adds to uneven shards is included. Activations and communication buffers are
    not: this is the persistent training state that sharding divides.

    Returns:
        ``{"params": int, "grads": int, "optimizer": int}`` in bytes.
    """
    from torch.distributed.tensor import DTensor

    seen: set[int] = set()
    out = {"params": 0, "grads": 0, "optimizer": 0}

    def add(key: str, t: Any) -> None:
        if not isinstance(t, torch.Tensor):
            return
        storage = (t.to_local() if isinstance(t, DTensor) else t).untyped_storage()
        if storage.nbytes() and storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            out[key] += storage.nbytes()

    for model in models:
        for p in model.parameters():
            add("params", p)
            add("grads", p.grad)
    for opt in optimizers:
        for state in opt.state.values():
            for v in state.values():
                add("optimizer", v)
    return out

