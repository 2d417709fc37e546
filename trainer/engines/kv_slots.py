"""A slot-based KV cache for continuous batching over ``transformers`` models.

Each running sequence owns one *slot* (a row of the buffers); its token at position ``p`` is
stored in column ``p``, so a slot's keys/values are columns ``[0, n)`` whatever the other
slots hold. Every layer keeps ``(slots, kv_heads, capacity, head_dim)`` key and value buffers
that grow (slots up to a maximum, capacity in blocks) and are written in place: a decode step
writes one column per row (``n_i`` of row ``i``), a prefill writes a group of new rows, and
attention reads the views ``buffer[rows, :, :window]`` with a per-row mask built by the caller
(:mod:`trainer.engines.continuous`). Nothing is concatenated per step, as
``transformers.DynamicCache`` does, and a finished sequence leaves by moving the last slot's
columns into its place (:meth:`SlotKVCache.move`), so running rows stay packed in
``[0, rows)``.

The class plugs into the models' ``cache=`` argument: it is a ``transformers`` ``Cache`` whose
layers implement ``update(key_states, value_states)`` for the current :class:`WritePlan`.
Buffers start as zeros and hold only finite values, so masked columns never turn into NaN.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

Tensor = torch.Tensor

#: Capacity grows in multiples of this many columns (tokens).
CAPACITY_BLOCK = 256


@dataclass
class WritePlan:
    """Where the next forward pass writes and what it reads.

    Attributes:
        rows: the slots of the batch, in order (a slice; row ``b`` of the batch is slot
            ``rows.start + b``).
        slot_idx: ``(R, 1)`` int64 slot of each batch row.
        cols: ``(R, q)`` int64 column each input position is written to (``q`` = query length).
        window: columns ``[0, window)`` the attention reads.
    """

    rows: slice
    slot_idx: Tensor
    cols: Tensor
    window: int


class SlotLayer(CacheLayerMixin):
    """One decoder layer's key/value buffers; writes and views follow the owner's plan."""

    def __init__(self, owner: SlotKVCache) -> None:
        super().__init__()
        self._owner = owner

    def lazy_initialization(self, key_states: Tensor, value_states: Tensor) -> None:
        """Allocate zero buffers of the owner's current size on the first write."""
        o = self._owner
        _, h, _, d = key_states.shape
        self.keys = key_states.new_zeros(o.slots, h, o.capacity, d)
        self.values = value_states.new_zeros(o.slots, h, o.capacity, value_states.shape[-1])
        self.is_initialized = True

    def update(self, key_states: Tensor, value_states: Tensor, *args, **kwargs) -> tuple[Tensor, Tensor]:
        """Write ``(R, kv_heads, q, head_dim)`` states at the plan's columns; return the read views."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        plan = self._owner.plan
        self.keys[plan.slot_idx, :, plan.cols] = key_states.transpose(1, 2)
        self.values[plan.slot_idx, :, plan.cols] = value_states.transpose(1, 2)
        return self.keys[plan.rows, :, : plan.window], self.values[plan.rows, :, : plan.window]

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        """``(kv_length, kv_offset)`` of the current plan (masks are built by the caller)."""
        return self._owner.plan.window, 0

    def get_seq_length(self) -> int:
        """Columns read by the current plan."""
        return self._owner.plan.window if self._owner.plan is not None else 0

    def get_max_length(self) -> int:
        """No fixed maximum: the buffers grow."""
        return -1

    def resize(self, slots: int, capacity: int) -> None:
        """Reallocate to ``(slots, ·, capacity, ·)``, keeping the old contents (zeros elsewhere)."""
        if not self.is_initialized:
            return
        for name in ("keys", "values"):
            old = getattr(self, name)
            new = old.new_zeros(slots, old.shape[1], capacity, old.shape[3])
            s, c = min(slots, old.shape[0]), min(capacity, old.shape[2])
            new[:s, :, :c] = old[:s, :, :c]
            setattr(self, name, new)


class SlotKVCache(Cache):
    """Per-slot KV storage for ``num_layers`` decoder layers (see the module docstring).

    Args:
        num_layers: decoder layers of the model.
        max_slots: most slots (the batcher's ``max_batch_size``).

    Attributes:
        slots / capacity: current buffer size (slots; columns).
        plan: the :class:`WritePlan` of the next forward pass.
    """

    def __init__(self, num_layers: int, max_slots: int) -> None:
        super().__init__(layers=[SlotLayer(self) for _ in range(num_layers)])
        self.max_slots = max_slots
        self.slots = 0
        self.capacity = 0
        self.plan: WritePlan | None = None

    def reserve(self, slots: int, columns: int) -> None:
        """Make room for ``slots`` slots and ``columns`` columns (grows, never shrinks).

        Slots double (up to ``max_slots``) and capacity grows to a multiple of
        :data:`CAPACITY_BLOCK` at least 1.5x the old one, so growth copies are rare.

        Raises:
            ValueError: if ``slots > max_slots``.
        """
        if slots > self.max_slots:
            raise ValueError(f"SlotKVCache.reserve: {slots} slots > max_slots={self.max_slots}")
        if slots <= self.slots and columns <= self.capacity:
            return
        new_slots = self.slots if slots <= self.slots else min(self.max_slots, max(slots, 2 * self.slots))
        new_cap = self.capacity
        if columns > self.capacity:
            want = max(columns, (3 * self.capacity) // 2)
            new_cap = -(-want // CAPACITY_BLOCK) * CAPACITY_BLOCK
        for layer in self.layers:
            layer.resize(new_slots, new_cap)
        self.slots, self.capacity = new_slots, new_cap

    def move(self, src: int, dst: int, columns: int) -> None:
        """Copy slot ``src``'s columns ``[0, columns)`` into slot ``dst`` (every layer)."""
        for layer in self.layers:
            if layer.is_initialized:
                layer.keys[dst, :, :columns] = layer.keys[src, :, :columns]
                layer.values[dst, :, :columns] = layer.values[src, :, :columns]

    def nbytes(self) -> int:
        """Bytes held by the buffers."""
        return sum(t.numel() * t.element_size() for layer in self.layers if layer.is_initialized
                   for t in (layer.keys, layer.values))

    def release(self) -> None:
        """Drop every buffer (they are re-allocated, as zeros, after the next :meth:`reserve`)."""
        for layer in self.layers:
            layer.keys = layer.values = None
            layer.is_initialized = False
        self.slots = self.capacity = 0
