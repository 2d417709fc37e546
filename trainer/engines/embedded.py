"""The embedded engine: in-process generation with continuous batching (the CPU default).

Concurrent :meth:`EmbeddedEngine.generate` calls are queued; one worker thread drives a
:class:`~trainer.engines.continuous.ContinuousBatcher`: at every decode step it admits waiting
requests into the free slots of the running batch (prefill, first token), decodes one token
for every running row, and returns each request the step it finishes. Requests of different
lengths therefore never wait for one another.

Weight updates drain the batch: :meth:`EmbeddedEngine.pause` stops admissions and waits until
every running request has finished, so a request is always finished on the weights it started
with and all tokens of one ``generate`` call carry one policy version (exactly the weights that
produced them). A multi-turn episode that spans an update has the old version on its earlier
turns and the new version on later ones (per-token versions record it).

A LoRA policy's updates (:meth:`EmbeddedEngine.update_adapter`) copy the adapter's tensors only:
the engine serves its base weights with the same peft LoRA layers as the learner (unmerged, so its
log-probs are the learner's for that adapter version); they drain the batch the same way.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import dataclasses
import logging
import threading
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from ..errors import ConfigError
from ..models.lora import AdapterWeights, LoraSettings, inject_lora, load_adapter_tensors
from .base import EngineClosedError, EngineError, GenerationResult, SamplingParams
from .continuous import BatchStats, ContinuousBatcher, Row
from .stop_strings import STOP_CONTEXT_TOKENS, STOP_MAX_PENDING_TOKENS, StopStringMatcher

log = logging.getLogger(__name__)

#: Seconds :meth:`EmbeddedEngine.close` (and the interpreter's exit) waits for the worker's step in
#: progress: a prefill of a real model's long prompts can take tens of seconds on a loaded CPU. The
#: worker is a daemon thread, and one still inside a torch op when the interpreter finalises takes the
#: process down with SIGABRT ("terminate called without an active exception", exit 134): a run that
#: stopped on a failure printed its one line, then aborted, when ``close`` gave up after 5 s.
CLOSE_WAIT_S = 600.0
#: Engines whose worker may still run; stopped at interpreter exit (:func:`_stop_workers_at_exit`).
_LIVE: weakref.WeakSet = weakref.WeakSet()

#: ``f(prompt_ids, new_ids, logits (V,)) -> logits (V,)`` — sampling-only logits hook.
LogitsProcessor = Callable[[list[int], list[int], torch.Tensor], torch.Tensor]

__all__ = ["STOP_CONTEXT_TOKENS", "STOP_MAX_PENDING_TOKENS", "EmbeddedEngine", "EmbeddedEngineConfig",
           "LogitsProcessor", "StopStringMatcher"]


@dataclass(frozen=True)
class EmbeddedEngineConfig:
    """Settings of :class:`EmbeddedEngine` (validated).

    Attributes:
        max_batch_size: most requests decoded together (sequences; the KV cache's slots).
        batch_wait_s: how long an idle engine waits for more requests before its first prefill
            (seconds); a running batch admits new requests at every step without waiting.
        device: torch device string.
        prefill_tokens: most padded prompt tokens in one prefill forward pass (tokens); more
            new requests are prefilled in several passes, grouped by length.
        reuse_prefix: keep finished requests' KV in their slots and reuse it for prompts that
            start with the same tokens (the next turn of an episode, a shared system prompt).
        park_slots: KV-cache slots kept beyond ``max_batch_size`` for such finished requests
            (each holds up to the longest sequence seen: memory, not compute).
        attn_implementation: attention kernel of the engine's own model copy (``"sdpa"`` or
            ``"eager"``; log-probs agree with either learner setting within 1e-5 in float32),
            or None to keep the model's (which must then be one of the two).
    """

    max_batch_size: int = 32
    batch_wait_s: float = 0.002
    device: str = "cpu"
    prefill_tokens: int = 8192
    reuse_prefix: bool = True
    park_slots: int = 8
    attn_implementation: str | None = "sdpa"

    def __post_init__(self) -> None:
        """Validate."""
        if self.max_batch_size < 1:
            raise ValueError(f"EmbeddedEngineConfig.max_batch_size={self.max_batch_size!r}: must be >= 1")
        if self.batch_wait_s < 0:
            raise ValueError(f"EmbeddedEngineConfig.batch_wait_s={self.batch_wait_s!r}: must be >= 0")
        if self.park_slots < 0:
            raise ValueError(f"EmbeddedEngineConfig.park_slots={self.park_slots!r}: must be >= 0")
        if self.prefill_tokens < 1:
            raise ValueError(f"EmbeddedEngineConfig.prefill_tokens={self.prefill_tokens!r}: must be >= 1")
        if self.attn_implementation not in (None, "sdpa", "eager"):
            raise ValueError(f"EmbeddedEngineConfig.attn_implementation={self.attn_implementation!r}: "
                             "must be 'sdpa', 'eager' or None")


@dataclass
class _Request:
    prompt_ids: list[int]
    params: SamplingParams
    future: asyncio.Future
    loop: asyncio.AbstractEventLoop


class EmbeddedEngine:
    """In-process :class:`~trainer.engines.base.InferenceEngine` over a ``transformers`` causal LM.

    Args:
        model: causal LM (eval mode; its parameters are owned by the engine: the learner's
            weights are *copied* in by :meth:`update_weights`).
        tokenizer: its tokenizer (EOS id and stop-string decoding).
        config: :class:`EmbeddedEngineConfig`.
        version: initial policy version.
        logits_processor: optional ``f(prompt_ids, new_ids, logits) -> logits`` applied per row
            to the ``(V,)`` logits *used for sampling only*; behavior log-probs are always taken
            from the raw logits (:mod:`trainer.logprobs`). Used to force scripted outputs in tests.
        adapter: a LoRA adapter to serve ``model`` with from the start (:meth:`update_adapter`).

    Raises:
        EngineError: ``adapter`` does not fit the model.
    """

    def __init__(self, model: torch.nn.Module, tokenizer, config: EmbeddedEngineConfig | None = None,
                 version: int = 0, logits_processor: LogitsProcessor | None = None,
                 adapter: AdapterWeights | None = None) -> None:
        self.config = config or EmbeddedEngineConfig()
        self.model = model.to(self.config.device).eval()
        if self.config.attn_implementation is not None:
            try:
                self.model.set_attn_implementation(self.config.attn_implementation)
            except (ValueError, ImportError) as e:
                raise EngineError(f"EmbeddedEngineConfig.attn_implementation="
                                  f"{self.config.attn_implementation!r}: {e}") from e
        #: the settings of the LoRA adapter served, None while the engine serves full weights
        self.lora: LoraSettings | None = None
        if adapter is not None:
            self._install_adapter(adapter)
        self.tokenizer = tokenizer
        self._batcher = ContinuousBatcher(self.model, tokenizer, self.config.max_batch_size,
                                          self.config.device, self.config.prefill_tokens, logits_processor,
                                          self.config.reuse_prefix, self.config.park_slots)
        self.max_len = self._batcher.max_len
        self._version = version
        self._queue: list[_Request] = []
        self._cv = threading.Condition()
        self._paused = False
        self._busy = False
        self._closed = False
        self._dead: EngineError | None = None  # set if the worker thread died
        self._taken: list[_Request] = []  # taken off the queue by the step in progress
        self._threads: int | None = None  # intra-op threads the worker sets before its next step
        self._worker = threading.Thread(target=self._run, name="copc-embedded-engine", daemon=True)
        self._worker.start()
        _LIVE.add(self)

    @property
    def version(self) -> int:
        """Policy version used for new tokens."""
        return self._version

    @property
    def logits_processor(self) -> LogitsProcessor | None:
        """The sampling-only hook (see the constructor); settable, applied from the next decode step."""
        return self._batcher.logits_processor

    @logits_processor.setter
    def logits_processor(self, proc: LogitsProcessor | None) -> None:
        self._batcher.logits_processor = proc

    @property
    def stats(self) -> BatchStats:
        """A copy of the batcher's counters (requests admitted, forward passes, rows per step)."""
        return dataclasses.replace(self._batcher.stats)

    async def generate(self, prompt_ids: Sequence[int], params: SamplingParams) -> GenerationResult:
        """Queue one request and wait for its result (see :class:`~trainer.engines.base.InferenceEngine`).

        Raises:
            EngineClosedError: if the engine is closed (also for requests queued or running when it closes).
            EngineError: if its worker thread died, the prompt is empty or too long, or decoding fails.
        """
        if self._closed:
            raise EngineClosedError("EmbeddedEngine is closed")
        if self._dead is not None:
            raise self._dead
        if not prompt_ids:
            raise EngineError("generate: prompt_ids is empty")
        if len(prompt_ids) >= self.max_len:
            raise EngineError(f"generate: prompt of {len(prompt_ids)} tokens does not fit the model's "
                              f"{self.max_len}-token context")
        loop = asyncio.get_running_loop()
        req = _Request(list(map(int, prompt_ids)), params, loop.create_future(), loop)
        with self._cv:
            if self._dead is not None:
                raise self._dead
            self._queue.append(req)
            self._cv.notify_all()
        return await req.future

    def set_intra_op_threads(self, n: int) -> None:
        """Run the engine's forward passes on ``n`` torch intra-op threads from its next step on.

        torch's intra-op thread count is per calling thread, so the engine's worker thread sets it
        itself (``torch.set_num_threads``; that also becomes the default of threads that start
        torch work later). ``copc train`` gives the held-out evaluations every core: nothing else
        computes while they run.

        Raises:
            ValueError: ``n`` is not an int >= 1.
        """
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"set_intra_op_threads: n={n!r} must be an int >= 1")
        with self._cv:
            self._threads = n

    async def pause(self) -> None:
        """Admit no new request and wait until every running one has finished (the batch drains)."""
        def _wait() -> None:
            with self._cv:
                self._paused = True
                self._cv.notify_all()  # an idle worker wakes to free the cache
                self._cv.wait_for(lambda: not self._busy)
        await asyncio.to_thread(_wait)

    async def resume(self) -> None:
        """Admit requests again."""
        with self._cv:
            self._paused = False
            self._cv.notify_all()

    async def update_weights(self, source: Mapping[str, torch.Tensor] | str | Path, version: int) -> None:
        """Copy new weights in (a state dict, or a checkpoint directory) as policy ``version``.

        Drains the batch first (:meth:`pause`), so no request mixes weights.

        Raises:
            EngineError: if the state dict does not match the model, or the engine serves a LoRA
                adapter (its updates are :meth:`update_adapter`).
        """
        if self.lora is not None:
            raise EngineError("update_weights: the engine serves a LoRA adapter; send adapter updates "
                              "(update_adapter) instead of full weights")
        await self.pause()
        try:
            if isinstance(source, str | Path):
                from transformers import AutoModelForCausalLM
                state = AutoModelForCausalLM.from_pretrained(source, local_files_only=True).state_dict()
            else:
                state = source
            try:
                with torch.no_grad():
                    self.model.load_state_dict(state, strict=True)
            except RuntimeError as e:
                raise EngineError(f"update_weights: state dict does not match the model: {e}") from e
            self._version = int(version)
        finally:
            await self.resume()

    async def update_adapter(self, adapter: AdapterWeights, version: int) -> None:
        """Serve the base weights with LoRA ``adapter`` as policy ``version``; only the adapter's
        tensors are copied (the first update injects its layers: :func:`~trainer.models.lora.inject_lora`).

        Drains the batch first (:meth:`pause`), so no request mixes adapter versions.

        Raises:
            EngineError: the adapter's settings differ from those served, or its tensors do not fit.
        """
        await self.pause()
        try:
            self._install_adapter(adapter)
            self._version = int(version)
        finally:
            await self.resume()

    @torch.no_grad()
    def _install_adapter(self, adapter: AdapterWeights) -> None:
        """Inject ``adapter``'s layers (first time) and copy its tensors in (batch drained)."""
        if self.lora is None:
            try:
                inject_lora(self.model, adapter.settings, key="adapter target_modules")
            except (ConfigError, ValueError) as e:
                raise EngineError(f"update_adapter: {e}") from e
            self.model.requires_grad_(False)
            self.model.to(self.config.device).eval()  # the new layers: engine device, no dropout
            self.lora = adapter.settings
        elif adapter.settings != self.lora:
            raise EngineError(f"update_adapter: adapter settings {adapter.settings.to_dict()} differ from "
                              f"those served {self.lora.to_dict()}")
        try:
            load_adapter_tensors(self.model, adapter.copy(self.config.device).tensors)
        except ValueError as e:
            raise EngineError(f"update_adapter: {e}") from e

    async def close(self) -> None:
        """Stop the worker after its current step, waiting for that step (at most
        :data:`CLOSE_WAIT_S` seconds); queued and running requests fail with :class:`EngineClosedError`."""
        pending = self._mark_closed()
        for r in pending:
            r.loop.call_soon_threadsafe(_set_exc, r.future, EngineClosedError("engine closed"))
        await asyncio.to_thread(self._join_worker)

    def _mark_closed(self) -> list[_Request]:
        """Admit nothing more and wake the worker; returns the queued requests (not started)."""
        with self._cv:
            self._closed = True
            pending, self._queue = self._queue, []
            self._cv.notify_all()
        return pending

    def _join_worker(self) -> None:
        """Wait for the worker to end its step in progress and stop (at most :data:`CLOSE_WAIT_S` s)."""
        self._worker.join(5.0)
        if self._worker.is_alive():
            log.info("embedded engine: waiting for its step in progress to end before closing")
            self._worker.join(CLOSE_WAIT_S)
        if self._worker.is_alive():  # kept in _LIVE: the interpreter's exit waits for it once more
            log.error("embedded engine: its worker is still in a step after %.0f s; the process may abort "
                      "at exit", CLOSE_WAIT_S + 5.0)
        else:
            _LIVE.discard(self)

    # -- worker thread ------------------------------------------------------------------
    def _run(self) -> None:
        """Worker thread: never dies silently (waiting callers would hang forever)."""
        try:
            self._serve()
        except BaseException as e:
            with self._cv:
                self._dead = EngineError(f"embedded engine worker died: {type(e).__name__}: {e}")
                pending, self._queue = self._queue, []
                self._busy = False
                self._cv.notify_all()
            running = [row.handle for row in self._batcher.abort_all()]
            _fail([*pending, *self._taken, *running], self._dead)
        else:
            _fail([row.handle for row in self._batcher.abort_all()], EngineClosedError("engine closed"))

    def _serve(self) -> None:
        b = self._batcher
        while True:
            with self._cv:
                self._cv.wait_for(lambda: self._closed or b.rows or (self._queue and not self._paused)
                                  or (self._paused and b.cache.nbytes() > 0))
                if self._closed:
                    return
                self._busy = True
            if not b.rows and not self._paused and self.config.batch_wait_s:  # let concurrent callers arrive
                threading.Event().wait(self.config.batch_wait_s)
            with self._cv:
                take = [] if self._paused else self._queue[: b.free_slots()]
                del self._queue[: len(take)]
                version = self._version  # cannot change while requests run (updates drain first)
                threads, self._threads = self._threads, None
            if threads is not None:
                torch.set_num_threads(threads)
            self._taken = take  # off the queue, maybe not yet in the batch: failed too if this step dies
            try:
                self._step([b.new_row(r, r.prompt_ids, r.params, version) for r in take])
            except Exception as e:  # reported to every request in the batch
                _fail([*take, *(row.handle for row in b.abort_all())],
                      EngineError(f"embedded engine decode failed: {type(e).__name__}: {e}"))
            self._taken = []
            if self._paused and not b.rows:  # drained for a weight update: parked KV is stale
                b.release()
            with self._cv:
                self._busy = bool(b.rows)
                self._cv.notify_all()

    def _step(self, new: list[Row]) -> None:
        """Admit ``new`` rows, decode one token for every running row, return finished requests."""
        b = self._batcher
        if new:
            b.admit(new)
            self._deliver(b.pop_finished())
        b.step()
        self._deliver(b.pop_finished())

    def _deliver(self, rows: list[Row]) -> None:
        for row in rows:
            res = GenerationResult(token_ids=row.new_ids, logprobs=row.logprobs,
                                   versions=[row.version] * len(row.new_ids), finish_reason=row.finish,
                                   text=self.tokenizer.decode(row.new_ids, skip_special_tokens=False))
            row.handle.loop.call_soon_threadsafe(_set_result, row.handle.future, res)


@atexit.register
def _stop_workers_at_exit() -> None:
    """At interpreter exit, stop the workers of engines never closed (or whose close gave up) and wait
    for their step in progress, so no daemon thread is inside a torch op when the interpreter
    finalises (SIGABRT, exit 134, instead of the exit status the program chose)."""
    for engine in list(_LIVE):
        if engine._worker.is_alive():
            engine._mark_closed()
            engine._join_worker()


def _fail(requests: list[_Request], err: EngineError) -> None:
    for r in requests:
        with contextlib.suppress(RuntimeError):  # the caller's event loop may be closed
            r.loop.call_soon_threadsafe(_set_exc, r.future, err)


def _set_result(fut: asyncio.Future, value: GenerationResult) -> None:
    if not fut.done():
        fut.set_result(value)


def _set_exc(fut: asyncio.Future, exc: Exception) -> None:
    if not fut.done():
        fut.set_exception(exc)
