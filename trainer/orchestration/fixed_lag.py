"""The fixed-lag half of :class:`~trainer.orchestration.loop.AsyncTrainingLoop` (``staleness_mode: fixed``).

Batches are generated in order; batch ``j`` (trained at step ``j``, learner at version ``j``)
entirely by policy version ``max(j − k, 0)`` taken from the loop's
:class:`~trainer.orchestration.lag.WeightHistory`. The engine is synced to that version once the
previous batch is fully generated, so it never changes weights inside a batch; prompts whose
episodes end by an infrastructure failure are replaced by new draws generated with the same
version. A mixin so the loop module stays one screenful of the bounded-mode logic; it reads and
writes the loop's attributes (``_cond``, ``ready``, ``history``, ``_pending``, ...).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from ..errors import TrainingError
from .lag import generating_version

log = logging.getLogger(__name__)


class FixedLagScheduling:
    """Producer and batch taking of the fixed-lag mode (mixed into ``AsyncTrainingLoop``)."""

    _batch_version: dict[int, int]

    async def _admit_fixed(self: Any, tasks: set[asyncio.Task]) -> None:
        """Generate batch after batch, batch ``j`` with policy version ``max(j − k, 0)``."""
        j, need = self.step, self.cfg.prompts_per_step
        while not self._stop and j < self.cfg.total_steps:
            gen = generating_version(j, self.cfg.fixed_lag)
            async with self._cond:
                await self._cond.wait_for(lambda: self._stop or self.version >= gen)  # noqa: B023
            if self._stop:
                break
            if gen not in self.history:  # resumed from a checkpoint without the kept versions
                log.warning("policy version %d is not kept (kept: %s); batch %d uses the oldest kept one",
                            gen, self.history.versions(), j)
                gen = self.history.versions()[0]
            if self._engine_version != gen:  # the previous batch is fully generated here
                await self.sync_weights(self.history.get(gen), gen)
                self._engine_version = gen
            self._batch_version[j] = gen
            while not self._stop:  # refill after infrastructure failures until the batch is whole
                async with self._cond:
                    running = sum(b == j for b in self._pending.values())
                    missing = need - self._batch_ready.get(j, 0) - running
                    if missing <= 0 and running == 0:
                        break
                    uids = [self.prompts.next() for _ in range(max(missing, 0))]
                    for uid in uids:
                        self.in_flight.add(uid)
                        self._pending[uid] = j
                for uid in uids:
                    self._launch(tasks, uid)
                async with self._cond:
                    await self._cond.wait()
            j += 1

    async def _take_fixed_batch(self: Any) -> list[Any]:
        """The groups generated for this step, ordered by prompt draw, once all are there.

        Raises:
            TrainingError: a rollout task failed, or a group has tokens of another policy version
                than the batch's lagged one (the engine did not apply the weights it was sent).
        """
        need, step = self.cfg.prompts_per_step, self.step
        async with self._cond:
            await self._cond.wait_for(lambda: self._failure is not None
                                      or self._batch_ready.get(step, 0) >= need)
            if self._failure is not None:
                raise self._failure
            batch = sorted((g for g in self.ready if g.batch == step), key=lambda g: g.uid)
            self.ready = [g for g in self.ready if g.batch != step]
            for old in [b for b in self._batch_ready if b < step]:  # the producer is past them
                del self._batch_ready[old]
            want = self._batch_version.pop(step)
        got = {v for g in batch for t in g.trajs for v, m in zip(t.versions, t.loss_mask, strict=True) if m}
        if got - {want}:
            raise TrainingError(f"step {step + 1}: fixed lag {self.cfg.fixed_lag} generates with policy "
                                f"version {want} but the batch has tokens of versions {sorted(got)}")
        return batch
