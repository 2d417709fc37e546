"""Micro-batching of concurrent search requests into one backend call.

Requests are queued on the event loop; one background task takes everything queued (up to
``max_batch_queries`` queries), runs a single ``search_fn(queries, k_max)`` in a worker
thread (so the event loop never blocks on encoding or scoring), and hands every request its
rows. While one batch runs, new requests accumulate, so batches grow with load without a
fixed waiting delay (optional ``max_wait_s`` adds one).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np

SearchFn = Callable[[Sequence[str], int], tuple[np.ndarray, np.ndarray]]


@dataclass
class _Item:
    queries: list[str]
    k: int
    future: asyncio.Future


class MicroBatcher:
    """Coalesces concurrent ``submit`` calls into batched ``search_fn`` calls.

    Args:
        search_fn: ``(queries, k) -> (indices (n, k'), scores (n, k'))``; called from a worker
            thread, one call at a time per worker.
        max_batch_queries: most queries per backend call (a larger single request still
            goes in one call of its own).
        max_wait_s: extra seconds to wait for more requests after the first (0 = none).
        workers: backend calls allowed to run at once (threads).
        post_fn: optional ``(indices_row, scores_row, k) -> Any`` applied per query in the
            worker thread (e.g. JSON formatting) so that work stays off the event loop too.

    Statistics (for tests and benchmarks): ``batches`` (backend calls made) and
    ``queries`` (queries answered).
    """

    def __init__(
        self,
        search_fn: SearchFn,
        max_batch_queries: int = 256,
        max_wait_s: float = 0.0,
        workers: int = 1,
        post_fn: Callable[[np.ndarray, np.ndarray, int], Any] | None = None,
    ) -> None:
        if max_batch_queries <= 0:
            raise ValueError(f"max_batch_queries must be > 0, got {max_batch_queries}")
        if max_wait_s < 0:
            raise ValueError(f"max_wait_s must be >= 0, got {max_wait_s}")
        if workers <= 0:
            raise ValueError(f"workers must be > 0, got {workers}")
        self._search_fn = search_fn
        self._post_fn = post_fn
        self.max_batch_queries = max_batch_queries
        self.max_wait_s = max_wait_s
        self._workers = workers
        self._queue: asyncio.Queue[_Item] | None = None
        self._executor: ThreadPoolExecutor | None = None
        self._tasks: list[asyncio.Task] = []
        self.batches = 0
        self.queries = 0

    async def start(self) -> None:
        """Start the batching tasks on the running event loop."""
        self._queue = asyncio.Queue()
        self._executor = ThreadPoolExecutor(self._workers, thread_name_prefix="retrieve")
        self._tasks = [asyncio.create_task(self._run()) for _ in range(self._workers)]

    async def stop(self) -> None:
        """Cancel the batching tasks, fail pending requests and shut the thread pool down."""
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await t
        self._tasks = []
        if self._queue is not None:
            while not self._queue.empty():
                item = self._queue.get_nowait()
                if not item.future.done():
                    item.future.set_exception(RuntimeError("retriever is shutting down"))
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)

    async def submit(self, queries: list[str], k: int) -> list[Any]:
        """Queue ``queries`` for top-``k`` search and wait for the results.

        Returns:
            One entry per query: ``post_fn(indices_row, scores_row, k)`` if set, else the
            ``(indices_row, scores_row)`` pair truncated to ``k``.

        Raises:
            RuntimeError: the batcher is not started or is shutting down.
            Exception: whatever ``search_fn`` raised for this batch.
        """
        if self._queue is None:
            raise RuntimeError("MicroBatcher.start() was not called")
        fut = asyncio.get_running_loop().create_future()
        await self._queue.put(_Item(queries, k, fut))
        return await fut

    def _take_batch(self, first: _Item) -> list[_Item]:
        assert self._queue is not None
        batch, n = [first], len(first.queries)
        while n < self.max_batch_queries and not self._queue.empty():
            item = self._queue.get_nowait()
            batch.append(item)
            n += len(item.queries)
        return batch

    def _compute(self, batch: list[_Item]) -> list[list[Any]]:
        queries = [q for item in batch for q in item.queries]
        k_max = max(item.k for item in batch)
        idx, scores = self._search_fn(queries, k_max)
        out, row = [], 0
        for item in batch:
            res = []
            for _ in item.queries:
                i, s = idx[row, : item.k], scores[row, : item.k]
                res.append(self._post_fn(i, s, item.k) if self._post_fn else (i, s))
                row += 1
            out.append(res)
        return out

    async def _run(self) -> None:
        assert self._queue is not None
        loop = asyncio.get_running_loop()
        while True:
            first = await self._queue.get()
            if self.max_wait_s > 0:
                await asyncio.sleep(self.max_wait_s)
            batch = self._take_batch(first)
            try:
                results = await loop.run_in_executor(self._executor, self._compute, batch)
            except Exception as exc:  # propagate to every waiting request
                for item in batch:
                    if not item.future.done():
                        item.future.set_exception(exc)
                continue
            self.batches += 1
            self.queries += sum(len(item.queries) for item in batch)
            for item, res in zip(batch, results, strict=True):
                if not item.future.done():
                    item.future.set_result(res)
