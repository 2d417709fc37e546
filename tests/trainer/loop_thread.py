"""An asyncio event loop running in a daemon thread, for module-scoped fixtures whose async clients
(a server engine's HTTP client and its conditions) must live on one loop across tests."""

from __future__ import annotations

import asyncio
import threading


class LoopThread:
    """One event loop in a thread; :meth:`run` runs a coroutine on it from the test's thread."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coro, timeout: float = 600.0):
        """The coroutine's result (raises what it raises; TimeoutError after ``timeout`` s)."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)
