"""A resumable stream of training prompts: seeded epoch permutations plus a re-queue."""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np


class PromptStream:
    """Draws prompts in a seeded order, epoch after epoch; dropped or unfinished ones go back first.

    Each draw has a unique integer ``uid`` (0, 1, 2, ...): draw ``uid`` is row
    ``perm_{uid // N}[uid % N]`` of ``samples``, ``perm_e`` a permutation seeded by
    ``(seed, e)``. The stream's whole state is ``{"cursor", "requeued"}`` (plain ints),
    so a resumed run continues exactly where the checkpoint left off.

    Args:
        samples: the training rows (non-empty).
        seed: permutation seed.

    Raises:
        ValueError: if ``samples`` is empty.
    """

    def __init__(self, samples: Sequence[Mapping[str, Any]], seed: int) -> None:
        if not samples:
            raise ValueError("PromptStream: no training samples")
        self.samples, self.seed = list(samples), seed
        self.cursor = 0
        self.requeued: deque[int] = deque()
        self._perms: dict[int, np.ndarray] = {}

    def row(self, uid: int) -> Mapping[str, Any]:
        """The sample of draw ``uid``."""
        n = len(self.samples)
        e = uid // n
        if e not in self._perms:
            self._perms[e] = np.random.default_rng([self.seed, e]).permutation(n)
        return self.samples[int(self._perms[e][uid % n])]

    def next(self) -> int:
        """The next draw uid (re-queued ones first)."""
        if self.requeued:
            return self.requeued.popleft()
        uid = self.cursor
        self.cursor += 1
        return uid

    def requeue(self, uids: Sequence[int]) -> None:
        """Put draws back at the front (in order), e.g. dropped as too stale."""
        self.requeued.extendleft(reversed(list(uids)))

    def state_dict(self, in_flight: Sequence[int] = ()) -> dict:
        """Resumable state; ``in_flight`` draws (not yet trained) are re-queued on resume."""
        return {"cursor": self.cursor, "requeued": sorted(set(in_flight)) + list(self.requeued)}

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict` output."""
        self.cursor = int(state["cursor"])
        self.requeued = deque(int(u) for u in state["requeued"])
