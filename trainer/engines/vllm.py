"""vLLM engine: the :class:`~trainer.engines.base.InferenceEngine` protocol over a vLLM server's
OpenAI-compatible HTTP API (``/v1/completions`` with token ids in and out, ``/v1/load_lora_adapter``).

The request body and the reading of the answer, and the log-prob convention they keep, are
:mod:`.vllm_protocol`'s; retries are :mod:`.http_retry`'s and the per-version LoRA adapters
:class:`~trainer.engines.sglang_lora.SGLangAdapters`' (the same logic as for SGLang). See
docs/engines.md (section "vLLM").
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import httpx

from .base import EngineError, GenerationResult, SamplingParams
from .http_retry import request_with_retries
from .sglang_lora import ADAPTER_PREFIX, SGLangAdapters
from .vllm_protocol import build_completion_payload, parse_completion_response

#: The worker-extension method a full-weight sync calls through ``/collective_rpc``.
RELOAD_METHOD = "copc_reload_weights"


@dataclass(frozen=True)
class VLLMEngineConfig:
    """How to reach one vLLM server (validated on construction).

    Attributes:
        base_url: e.g. ``http://127.0.0.1:8000`` (``VLLMLauncher.url``).
        served_model_name: the served base model's name (``--served-model-name``).
        request_timeout_s: deadline of one call in seconds, retries and back-off included.
        connect_timeout_s: seconds to open a connection.
        max_retries: retries after a connection error or a 5xx answer (0: none).
        backoff_s: first retry delay in seconds; doubled after each retry.
        initial_version: policy version of the weights the server was started with.
        vocab_size: the tokenizer's size (a generated id at or above it is an :class:`EngineError`), or None.
        initial_lora: the adapter requests use until :meth:`VLLMEngine.load_adapter` (loaded by the
            caller before), or None (requests use the base model).
        keep_adapters: adapters kept loaded, the current one included (k + 1 for a fixed lag k).
        adapter_prefix: the adapter names' prefix (a run's own on a shared server).
        unload_on_close: unload every adapter on :meth:`VLLMEngine.close` (a server this run
            attached to and does not end).

    Raises:
        ValueError: naming the field and value.
    """

    base_url: str
    served_model_name: str = "policy"
    request_timeout_s: float = 600.0
    connect_timeout_s: float = 10.0
    max_retries: int = 3
    backoff_s: float = 0.5
    initial_version: int = 0
    vocab_size: int | None = None
    initial_lora: str | None = None
    keep_adapters: int = 2
    adapter_prefix: str = ADAPTER_PREFIX
    unload_on_close: bool = False

    def __post_init__(self) -> None:
        """Validate every field."""
        def bad(name: str, why: str) -> ValueError:
            return ValueError(f"VLLMEngineConfig.{name}={getattr(self, name)!r}: {why}")

        if not isinstance(self.base_url, str) or not self.base_url.startswith(("http://", "https://")):
            raise bad("base_url", "must be an http(s) URL")
        for name in ("request_timeout_s", "connect_timeout_s"):
            if not getattr(self, name) > 0:
                raise bad(name, "must be > 0 (seconds)")
        for name in ("max_retries", "initial_version"):
            if isinstance(getattr(self, name), bool) or not isinstance(getattr(self, name), int) \
                    or getattr(self, name) < 0:
                raise bad(name, "must be an int >= 0")
        if not self.backoff_s >= 0:
            raise bad("backoff_s", "must be >= 0 (seconds)")
        if isinstance(self.keep_adapters, bool) or not isinstance(self.keep_adapters, int) \
                or self.keep_adapters < 1:
            raise bad("keep_adapters", "must be an int >= 1")


class VLLMEngine:
    """Async :class:`~trainer.engines.base.InferenceEngine` talking to a vLLM server.

    Versions: a LoRA policy serves one adapter per policy version (:meth:`load_adapter`); a request
    names the adapter of the version current when it is admitted, so all its tokens, and its
    log-probs, come from that version, and no request waits for a sync. A full-weight policy is
    reloaded in place (:meth:`update_weights`): admission pauses while in-flight requests drain, so
    every request is generated, and tagged, with one version.

    Raises:
        EngineError: from every call, after the last retry or on a malformed answer.
    """

    def __init__(self, config: VLLMEngineConfig, on_unloaded: Callable[[str], None] | None = None) -> None:
        """Create the HTTP client (no request is sent). ``on_unloaded(name)`` runs after an adapter
        was unloaded from the server."""
        self.config = config
        self._version = config.initial_version
        self._client = httpx.AsyncClient(
            base_url=config.base_url.rstrip("/"),
            timeout=httpx.Timeout(config.request_timeout_s, connect=config.connect_timeout_s))
        self._cond = asyncio.Condition()
        self._inflight = 0
        self._paused = False
        self._update_lock = asyncio.Lock()
        #: the LoRA adapters served, one per policy version
        self.adapters = SGLangAdapters(self._post_control, self._cond, config.initial_lora,
                                       keep=config.keep_adapters, on_unloaded=on_unloaded,
                                       prefix=config.adapter_prefix)

    @property
    def version(self) -> int:
        """Policy version used for newly admitted requests."""
        return self._version

    async def _request(self, method: str, path: str, json: Any = None) -> httpx.Response:
        """One call with retries (:func:`~trainer.engines.http_retry.request_with_retries`)."""
        cfg = self.config
        return await request_with_retries(self._client, method, path, json, label="vLLM",
                                          base_url=cfg.base_url, request_timeout_s=cfg.request_timeout_s,
                                          max_retries=cfg.max_retries, backoff_s=cfg.backoff_s)

    async def _post_control(self, path: str, body: Any) -> str:
        """POST to vLLM's ``/v1<path>`` control endpoint (``/load_lora_adapter``, ...): a 2xx answer
        (plain text) is success, anything else an :class:`EngineError`."""
        return (await self._request("POST", "/v1" + path, json=body)).text

    async def generate(self, prompt_ids: Sequence[int], params: SamplingParams) -> GenerationResult:
        """Generate from ``prompt_ids`` with the adapter (or base model) of the current version.

        Raises:
            ValueError: bad ``prompt_ids``, or greedy at a temperature other than 1 (refused: see
                :mod:`.vllm_protocol`).
            EngineError: HTTP failure after retries, or a malformed answer.
        """
        build_completion_payload(prompt_ids, params, self.config.served_model_name)  # refuse before waiting
        async with self._cond:
            await self._cond.wait_for(lambda: not self._paused)
            self._inflight += 1
            version, lora = self._version, self.adapters.acquire()
        try:
            payload = build_completion_payload(prompt_ids, params, lora or self.config.served_model_name)
            resp = await self._request("POST", "/v1/completions", json=payload)
            try:
                body = resp.json()
            except ValueError as e:
                raise EngineError(f"vLLM /v1/completions: answer is not JSON: {resp.text[:300]!r}") from e
        finally:
            async with self._cond:
                self._inflight -= 1
                self.adapters.release(lora)
                self._cond.notify_all()
        result = parse_completion_response(body, version, max_new_tokens=params.max_new_tokens,
                                           vocab_size=self.config.vocab_size)
        result.meta["adapter"] = lora
        return result

    async def load_adapter(self, source: str | os.PathLike, version: int) -> str:
        """Serve the PEFT adapter directory ``source`` as policy ``version`` (``/v1/load_lora_adapter``
        under a name carrying the version); new requests use it, requests admitted before keep theirs.

        Returns:
            The adapter's name on the server.

        Raises:
            ValueError: ``version`` is not an int >= 0.
            EngineError: the server refused (e.g. started without LoRA, a rank above its maximum).
        """
        if isinstance(version, bool) or not isinstance(version, int) or version < 0:
            raise ValueError(f"version={version!r}: must be an int >= 0")
        async with self._update_lock:
            return await self.adapters.load(source, version, lambda: setattr(self, "_version", version))

    async def update_weights(self, source: object, version: int) -> None:
        """Serve the full weights in directory ``source`` (``*.safetensors`` in the model's Hugging Face
        names) as policy ``version``, reloaded in place with every request drained.

        This client stops admitting requests and waits for its in-flight ones (each is generated
        entirely by the weights it was admitted with, and tagged with their version); then
        ``POST /pause?mode=wait`` drains the server's (the default mode would abort them), ``POST
        /collective_rpc`` runs :data:`RELOAD_METHOD` (vLLM's ``reload_weights`` and the repack of a tied
        output head: ``trainer/engines/vllm_ext/copc_vllm_ext.py``; the server needs
        ``VLLMLauncherConfig.reload_weights``), ``POST /resume``, and requests are admitted again as
        ``version``.

        Raises:
            ValueError: ``version`` is not an int >= 0.
            EngineError: the server refused or failed (the version is then unchanged).
        """
        if isinstance(version, bool) or not isinstance(version, int) or version < 0:
            raise ValueError(f"version={version!r}: must be an int >= 0")
        async with self._update_lock:
            await self.pause()
            try:
                await self._request("POST", "/pause?mode=wait")
                try:
                    body = {"method": RELOAD_METHOD, "kwargs": {"weights_path": str(source)}}
                    r = await self._request("POST", "/collective_rpc", json=body)
                finally:
                    await self._request("POST", "/resume")
                results = r.json().get("results") if r.content else None
                if not results or not all(isinstance(x, dict) for x in results):
                    raise EngineError(f"vLLM POST /collective_rpc {RELOAD_METHOD}: unexpected answer "
                                      f"{r.text[:300]!r} (is the server started with reload_weights?)")
                bad = [x for x in results if x.get("tied") and not x.get("repacked")]
                if bad:
                    raise EngineError(f"vLLM {RELOAD_METHOD}: the model ties its embeddings but its output "
                                      f"head could not be repacked ({bad[0]}): it would keep the old head")
                self._version = version
            finally:
                await self.resume()

    async def pause(self) -> None:
        """Stop admitting requests and wait for this client's in-flight ones to finish."""
        async with self._cond:
            self._paused = True
            await self._cond.wait_for(lambda: self._inflight == 0)

    async def resume(self) -> None:
        """Admit requests again."""
        async with self._cond:
            self._paused = False
            self._cond.notify_all()

    async def close(self) -> None:
        """Finish pending adapter unloads (with ``unload_on_close``: unload every adapter) and close
        the HTTP client (the server is the launcher's)."""
        if self.config.unload_on_close:
            await self.adapters.unload_all()
        await self.adapters.close()
        await self._client.aclose()
