"""LoRA adapters on an SGLang server: which adapter this client's requests use, loading and retiring.

SGLang's protocol (docs ``advanced_features/lora``, ``srt/entrypoints/http_server.py`` and
``srt/managers/io_struct.py``): a server started with ``--enable-lora --max-lora-rank R
--lora-target-modules ...`` (optionally ``--lora-paths NAME=DIR`` at start-up) loads a PEFT adapter
directory with ``POST /load_lora_adapter {"lora_name", "lora_path"}`` and drops it with ``POST
/unload_lora_adapter {"lora_name"}``; both answer ``{"success": bool, "error_message": ...,
"loaded_adapters": ...}`` (HTTP 400 on failure). A ``/generate`` request names its adapter with
``"lora_path": NAME``; requests of different adapters share batches, and the radix (prefix) cache is
keyed by the adapter, so nothing computed with one adapter is reused by another.

:class:`SGLangAdapters` gives every policy version its own adapter name, so no pause is needed: a
new version is loaded while requests go on, new requests name it, requests admitted before keep the
old adapter (and version) until they finish, and the old adapter is unloaded once this client has
no request left on it (in the background; :meth:`SGLangAdapters.close` waits for it).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
from collections import Counter
from collections.abc import Awaitable, Callable
from typing import Any

from .base import EngineError

log = logging.getLogger(__name__)

#: Prefix of the adapter names this client loads (``copc-<n>-v<version>``).
ADAPTER_PREFIX = "copc-"


def adapter_name(seq: int, version: int, prefix: str = ADAPTER_PREFIX) -> str:
    """The server-side name of the ``seq``-th adapter this client loads, of policy ``version``
    (``prefix``: a run's own on a shared server, :func:`~.vllm_attach.run_adapter_prefix`)."""
    return f"{prefix}{seq}-v{version}"


class SGLangAdapters:
    """The LoRA adapters one :class:`~trainer.engines.sglang.SGLangEngine` serves.

    Args:
        post: ``await post(path, body)`` of a control endpoint answering ``{"success": true, ...}``
            (raises :class:`EngineError` otherwise).
        cond: the engine's condition (guards admission; the counts here are changed under it).
        initial: the adapter the server was started with (``--lora-paths``), or None.
        keep: adapters kept loaded, the active one included (>= 1): a load retires the adapters
            older than the last ``keep`` (each once no request of this client uses it). 1 (SGLang's
            default): only the active one; the vLLM engine keeps the k + 1 versions of a fixed lag k.
        on_unloaded: ``on_unloaded(name)`` after an adapter was unloaded (e.g. remove its directory).
        prefix: the adapter names' prefix (:func:`adapter_name`).
    """

    def __init__(self, post: Callable[[str, Any], Awaitable[Any]], cond: asyncio.Condition,
                 initial: str | None = None, *, keep: int = 1,
                 on_unloaded: Callable[[str], None] | None = None, prefix: str = ADAPTER_PREFIX) -> None:
        if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
            raise ValueError(f"keep={keep!r}: must be an int >= 1")
        self._post, self._cond = post, cond
        self._keep, self._on_unloaded, self._prefix = keep, on_unloaded, prefix
        self.active: str | None = initial
        #: the adapters loaded (oldest first), the active one last
        self.loaded: list[str] = [initial] if initial is not None else []
        self.inflight: Counter[str] = Counter()
        self._seq = itertools.count(1)
        self._retiring: set[asyncio.Task] = set()

    def acquire(self) -> str | None:
        """The adapter a request admitted now uses (counted until :meth:`release`); call under ``cond``."""
        if self.active is not None:
            self.inflight[self.active] += 1
        return self.active

    def release(self, name: str | None) -> None:
        """A request on ``name`` finished; call under ``cond`` (and notify)."""
        if name is not None:
            self.inflight[name] -= 1

    async def load(self, path: str | os.PathLike, version: int, switch: Callable[[], None]) -> str:
        """Load the PEFT adapter directory ``path`` as policy ``version`` and make new requests use it
        (``switch()`` runs in the same critical section: the engine moves its version there); the
        adapters older than the last ``keep`` are unloaded once their requests are done. Returns the
        new name.

        Raises:
            EngineError: the server refused the adapter (the previous one stays active).
        """
        name = adapter_name(next(self._seq), version, self._prefix)
        await self._post("/load_lora_adapter", {"lora_name": name, "lora_path": os.fspath(path)})
        async with self._cond:
            self.active = name
            self.loaded.append(name)
            switch()
            retired, self.loaded = self.loaded[:-self._keep], self.loaded[-self._keep:]
        for old in retired:
            task = asyncio.create_task(self._retire(old))
            self._retiring.add(task)
            task.add_done_callback(self._retiring.discard)
        return name

    async def _retire(self, name: str) -> None:
        """Unload ``name`` once no request of this client uses it (a failure is logged, not raised:
        the adapter only stays loaded)."""
        async with self._cond:
            await self._cond.wait_for(lambda: self.inflight[name] <= 0)
            del self.inflight[name]
        try:
            await self._post("/unload_lora_adapter", {"lora_name": name})
        except EngineError as e:
            log.warning("could not unload LoRA adapter %s: %s", name, e)
            return
        if self._on_unloaded is not None:
            self._on_unloaded(name)

    async def unload_all(self) -> None:
        """Unload every adapter still loaded (a server this run shares with others keeps none of
        its adapters), each once no request uses it; a failure is logged, not raised."""
        async with self._cond:
            names, self.loaded, self.active = self.loaded, [], None
        for name in names:
            await self._retire(name)

    async def close(self, timeout_s: float = 5.0) -> None:
        """Wait up to ``timeout_s`` seconds for the pending unloads (before the HTTP client closes),
        then cancel those still waiting for requests."""
        tasks = list(self._retiring)
        if tasks:
            _, pending = await asyncio.wait(tasks, timeout=timeout_s)
            for t in pending:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
