"""Parked sequences: finished requests whose KV stays in its cache slot, for reuse by later prompts.

In agent loops each turn re-sends the whole conversation: the next prompt is the previous
prompt, the generated tokens and the tool's answer. When a request finishes, the batcher
*parks* its slot instead of freeing it (the slot's columns ``[0, n)`` hold the KV of its first
``n`` tokens); a later prompt that starts with the same tokens (the same episode's next turn,
or another request with the same system prompt) reuses the common prefix and prefills only the
rest. Parked slots are ordinary free slots for admission purposes: the least recently used
one is given up when a slot is needed.

KV is only valid for the weights that computed it: every entry records its policy version and
only matches prompts admitted under the same version (the engine drains the batch before a
weight update, so the version of a running row is exactly that of its weights).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch

Tensor = torch.Tensor

#: Shortest common prefix worth reusing (tokens); shorter matches are prefilled.
MIN_REUSE_TOKENS = 16


def common_prefix(a: Tensor, b: Tensor) -> int:
    """Length of the longest common prefix of two ``(n,)`` int64 tensors."""
    m = min(len(a), len(b))
    if m == 0 or a[0] != b[0]:
        return 0
    diff = (a[:m] != b[:m]).nonzero()
    return m if diff.numel() == 0 else int(diff[0])


@dataclass
class Parked:
    """A parked slot.

    Attributes:
        slot: cache slot holding the KV.
        tokens: ``(n,)`` int64 ids whose KV fills columns ``[0, n)``.
        version: policy version of the weights that computed it.
        stamp: last use (larger: more recent).
    """

    slot: int
    tokens: Tensor
    version: int
    stamp: int = 0


@dataclass
class ParkedPrefixes:
    """The parked slots of one cache, and the longest-common-prefix search over them.

    Attributes:
        min_tokens: shortest reusable prefix (tokens).
        entries: parked entries by slot.
    """

    min_tokens: int = MIN_REUSE_TOKENS
    entries: dict[int, Parked] = field(default_factory=dict)
    _clock: itertools.count = field(default_factory=itertools.count, repr=False)

    def add(self, slot: int, tokens: list[int], version: int) -> None:
        """Park ``slot`` holding the KV of ``tokens`` (ignored when shorter than ``min_tokens``)."""
        if len(tokens) >= self.min_tokens:
            ids = torch.tensor(tokens, dtype=torch.long)
            self.entries[slot] = Parked(slot, ids, version, next(self._clock))

    def pop(self, slot: int) -> Parked | None:
        """Un-park ``slot`` (its KV is given up or taken over); the entry, if there was one."""
        return self.entries.pop(slot, None)

    def move(self, src: int, dst: int) -> None:
        """Record that the entry of ``src`` now lives in slot ``dst`` (after a copy)."""
        e = self.entries.pop(src)
        e.slot = dst
        self.entries[dst] = e

    def retain_version(self, version: int) -> None:
        """Drop every entry of another policy version (its KV belongs to other weights)."""
        for slot in [s for s, e in self.entries.items() if e.version != version]:
            del self.entries[slot]

    def match(self, prompt: Tensor, version: int, extra: Iterable[Parked] = ()) -> tuple[Parked | None, int]:
        """The entry (or ``extra`` source, e.g. a running row's prompt) sharing the longest prefix
        with ``prompt`` (``(n,)`` int64), and that prefix's length.

        The length is at most ``n - 1`` (the last prompt token is always computed, for its
        logits); matches under ``min_tokens`` or of another version count as none. Ties go to
        the source ``prompt`` extends completely, then to the most recently used.
        """
        best, best_key = None, (self.min_tokens - 1, False, -1)
        for e in itertools.chain(self.entries.values(), extra):
            if e.version != version:
                continue
            n = common_prefix(e.tokens, prompt[:-1])
            key = (n, n == len(e.tokens), e.stamp)
            if key > best_key:
                best, best_key = e, key
        if best is None:
            return None, 0
        best.stamp = next(self._clock)
        return best, best_key[0]

    def least_recent(self, exclude: set[int] = frozenset()) -> Parked | None:
        """The least recently used entry whose slot is not in ``exclude``."""
        cands = [e for s, e in self.entries.items() if s not in exclude]
        return min(cands, key=lambda e: e.stamp) if cands else None
