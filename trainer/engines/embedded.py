"""The embedded engine: in-process, batched generation with a KV cache (the CPU default).

Concurrent :meth:`EmbeddedEngine.generate` calls are queued; a worker thread takes
up to ``max_batch_size`` waiting requests, left-pads them into one batch and
decodes them together with the model's KV cache until each has finished. New
requests join at the next round.

Weight updates happen between rounds: a request is always finished on the weights
it started with, so all tokens of one ``generate`` call carry one policy version.
A multi-turn episode that spans an update therefore has the old version on its
earlier turns and the new version on later ones (per-token versions record it).

A LoRA policy's updates (:meth:`EmbeddedEngine.update_adapter`) copy the adapter's tensors only:
the engine serves its base weights with the same peft LoRA layers as the learner (unmerged, so its
log-probs are the learner's for that adapter version).
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..errors import ConfigError
from ..models.lora import AdapterWeights, LoraSettings, inject_lora, load_adapter_tensors
from .base import EngineError, GenerationResult, SamplingParams
from .sampling import sample_next
from .stop_strings import STOP_CONTEXT_TOKENS, STOP_MAX_PENDING_TOKENS, StopStringMatcher

#: ``f(prompt_ids, new_ids, logits (V,)) -> logits (V,)`` — sampling-only logits hook.
LogitsProcessor = Callable[[list[int], list[int], torch.Tensor], torch.Tensor]

__all__ = ["STOP_CONTEXT_TOKENS", "STOP_MAX_PENDING_TOKENS", "EmbeddedEngine", "EmbeddedEngineConfig",
           "LogitsProcessor", "StopStringMatcher"]


@dataclass(frozen=True)
class EmbeddedEngineConfig:
    """Settings of :class:`EmbeddedEngine` (validated).

    Attributes:
        max_batch_size: most requests decoded together (sequences).
        batch_wait_s: how long a new round waits for more requests to arrive (seconds).
        device: torch device string.
    """

    max_batch_size: int = 32
    batch_wait_s: float = 0.002
    device: str = "cpu"

    def __post_init__(self) -> None:
        """Validate."""
        if self.max_batch_size < 1:
            raise ValueError(f"EmbeddedEngineConfig.max_batch_size={self.max_batch_size!r}: must be >= 1")
        if self.batch_wait_s < 0:
            raise ValueError(f"EmbeddedEngineConfig.batch_wait_s={self.batch_wait_s!r}: must be >= 0")


@dataclass
class _Request:
    prompt_ids: list[int]
    params: SamplingParams
    future: asyncio.Future
    loop: asyncio.AbstractEventLoop
    new_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish: str | None = None


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
        #: the settings of the LoRA adapter served, None while the engine serves full weights
        self.lora: LoraSettings | None = None
        if adapter is not None:
            self._install_adapter(adapter)
        self.tokenizer = tokenizer
        self.eos_id = tokenizer.eos_token_id
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else self.eos_id
        self.max_len = int(getattr(model.config, "max_position_embeddings", 1 << 30))
        self._version = version
        self.logits_processor = logits_processor
        self._queue: list[_Request] = []
        self._cv = threading.Condition()
        self._paused = False
        self._busy = False
        self._closed = False
        self._dead: EngineError | None = None  # set if the worker thread died
        self._current: list[_Request] = []  # the batch being decoded
        self._worker = threading.Thread(target=self._run, name="copc-embedded-engine", daemon=True)
        self._worker.start()

    @property
    def version(self) -> int:
        """Policy version used for new tokens."""
        return self._version

    async def generate(self, prompt_ids: Sequence[int], params: SamplingParams) -> GenerationResult:
        """Queue one request and wait for its result (see :class:`~trainer.engines.base.InferenceEngine`).

        Raises:
            EngineError: if the engine is closed, its worker thread died, the prompt is empty or too
                long, or decoding fails.
        """
        if self._closed:
            raise EngineError("EmbeddedEngine is closed")
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

    async def pause(self) -> None:
        """Admit no new round and wait until the current one (if any) has finished."""
        def _wait() -> None:
            with self._cv:
                self._paused = True
                self._cv.wait_for(lambda: not self._busy)
        await asyncio.to_thread(_wait)

    async def resume(self) -> None:
        """Allow new rounds again."""
        with self._cv:
            self._paused = False
            self._cv.notify_all()

    async def update_weights(self, source: Mapping[str, torch.Tensor] | str | Path, version: int) -> None:
        """Copy new weights in (a state dict, or a checkpoint directory) as policy ``version``.

        Pauses between rounds, so no request mixes weights.

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

        Pauses between rounds, so no request mixes adapter versions.

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
        """Inject ``adapter``'s layers (first time) and copy its tensors in (between rounds)."""
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
        """Stop the worker; pending requests fail with :class:`EngineError`."""
        with self._cv:
            self._closed = True
            pending, self._queue = self._queue, []
            self._cv.notify_all()
        for r in pending:
            r.loop.call_soon_threadsafe(_set_exc, r.future, EngineError("engine closed"))
        await asyncio.to_thread(self._worker.join, 5.0)

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
            for r in [*pending, *self._current]:
                with contextlib.suppress(RuntimeError):  # the caller's event loop may be closed
                    r.loop.call_soon_threadsafe(_set_exc, r.future, self._dead)

    def _serve(self) -> None:
        while True:
            with self._cv:
                self._cv.wait_for(lambda: self._closed or (self._queue and not self._paused))
                if self._closed:
                    return
                self._busy = True
            try:
                if self.config.batch_wait_s:
                    threading.Event().wait(self.config.batch_wait_s)
                with self._cv:
                    batch = self._queue[: self.config.max_batch_size]
                    del self._queue[: len(batch)]
                self._current = batch
                version = self._version
                try:
                    self._decode(batch)
                    for r in batch:
                        res = GenerationResult(
                            token_ids=r.new_ids, logprobs=r.logprobs, versions=[version] * len(r.new_ids),
                            finish_reason=r.finish or "length",
                            text=self.tokenizer.decode(r.new_ids, skip_special_tokens=False))
                        r.loop.call_soon_threadsafe(_set_result, r.future, res)
                except Exception as e:  # reported to every waiting caller
                    err = EngineError(f"embedded engine decode failed: {type(e).__name__}: {e}")
                    for r in batch:
                        r.loop.call_soon_threadsafe(_set_exc, r.future, err)
            finally:
                with self._cv:
                    self._busy = False
                    self._cv.notify_all()

    @torch.no_grad()
    def _decode(self, batch: list[_Request]) -> None:
        """Decode ``batch`` to completion with one left-padded KV cache."""
        dev = self.config.device
        n = len(batch)
        lp = max(len(r.prompt_ids) for r in batch)
        ids = torch.full((n, lp), self.pad_id, dtype=torch.long)
        attn = torch.zeros(n, lp, dtype=torch.long)
        for i, r in enumerate(batch):
            ids[i, lp - len(r.prompt_ids):] = torch.tensor(r.prompt_ids)
            attn[i, lp - len(r.prompt_ids):] = 1
        ids, attn = ids.to(dev), attn.to(dev)
        pos = (attn.cumsum(1) - 1).clamp(min=0)
        gens = [torch.Generator(device=dev).manual_seed(r.params.seed) if r.params.seed is not None
                else None for r in batch]
        params = [r.params for r in batch]
        matchers = [StopStringMatcher(self.tokenizer, r.params.stop, r.prompt_ids) if r.params.stop
                    else None for r in batch]
        out = self.model(input_ids=ids, attention_mask=attn, position_ids=pos, use_cache=True,
                         logits_to_keep=1)
        past, logits = out.cache, out.logits[:, -1]
        cur = pos[:, -1]
        active = torch.ones(n, dtype=torch.bool)
        max_steps = min(max(p.max_new_tokens for p in params), self.max_len - lp)
        pad_col = torch.full((n,), self.pad_id, dtype=torch.long, device=dev)
        for _ in range(max_steps):
            tok, logp = sample_next(logits, params, gens, self._processed(batch, logits))
            toks, logps = tok.tolist(), logp.tolist()  # one device->host copy per step
            for i, r in enumerate(batch):
                if r.finish:
                    continue
                t = toks[i]
                r.new_ids.append(t)
                r.logprobs.append(logps[i])
                if t == self.eos_id and not r.params.ignore_eos:
                    r.finish = "eos"
                elif matchers[i] is not None and matchers[i].push(t) is not None:
                    r.finish = "stop"
                elif len(r.new_ids) >= r.params.max_new_tokens or lp + len(r.new_ids) >= self.max_len:
                    r.finish = "length"
                if r.finish:
                    active[i] = False
            if not active.any():
                break
            active_dev = active.to(dev)
            step_ids = torch.where(active_dev, tok, pad_col)
            attn = torch.cat([attn, active_dev.long()[:, None]], dim=1)
            cur = cur + 1
            out = self.model(input_ids=step_ids[:, None], attention_mask=attn, position_ids=cur[:, None],
                             cache=past, use_cache=True)
            past, logits = out.cache, out.logits[:, -1]
        for r in batch:
            r.finish = r.finish or "length"


    def _processed(self, batch: list[_Request], logits: torch.Tensor) -> torch.Tensor | None:
        """Sampling logits after the optional processor (None when there is none)."""
        if self.logits_processor is None:
            return None
        return torch.stack([self.logits_processor(r.prompt_ids, r.new_ids, logits[i])
                            for i, r in enumerate(batch)])


def _set_result(fut: asyncio.Future, value: GenerationResult) -> None:
    if not fut.done():
        fut.set_result(value)


def _set_exc(fut: asyncio.Future, exc: Exception) -> None:
    if not fut.done():
        fut.set_exception(exc)
