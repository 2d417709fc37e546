"""SGLang engine: the :class:`~trainer.engines.base.InferenceEngine` protocol over SGLang's
native HTTP API (``/generate``, ``/update_weights_from_disk``, ``/pause_generation``, ...).

The ``/generate`` request and answer, and the log-prob convention they keep (SGLang >= 0.4.7:
``log softmax(logits / temperature)[token]``, as :mod:`trainer.logprobs`), are
:mod:`.sglang_protocol`'s.

See docs/engines.md (section "SGLang").
"""

from __future__ import annotations

import asyncio
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import httpx

from trainer.engines.base import EngineError, GenerationResult, SamplingParams
from trainer.engines.http_retry import request_with_retries
from trainer.engines.sglang_lora import SGLangAdapters
from trainer.engines.sglang_protocol import build_generate_payload, parse_generate_response

#: Oldest SGLang whose returned log-probs follow :mod:`.sglang_protocol`'s convention.
MIN_SGLANG_VERSION = (0, 4, 7)


@dataclass(frozen=True)
class SGLangEngineConfig:
    """How to reach one SGLang server (validated on construction).

    Attributes:
        base_url: e.g. ``http://127.0.0.1:30000`` (``SGLangLauncher.url``).
        request_timeout_s: total seconds one call may take (a whole generation), retries and
            back-off included — a deadline, not a per-read timeout: a server that trickles
            bytes still fails the call once it is reached (:class:`EngineError`).
        connect_timeout_s: seconds to open a connection.
        max_retries: retries after a connection error or a 5xx answer (0: none).
        backoff_s: first retry delay in seconds; doubled after each retry.
        pause_mode: ``mode`` sent to ``/pause_generation`` (``abort``, ``retract``,
            ``in_place``). :meth:`SGLangEngine.pause` first drains this client's own
            requests, so the mode only matters for other clients of the same server;
            ``retract`` keeps their requests and lets ``/flush_cache`` succeed.
        forward_seed: send ``SamplingParams.seed`` as ``sampling_params.sampling_seed``.
            Off by default: SGLang honours it only with ``--sampling-backend pytorch``
            (with the flashinfer backend a seeded top-p/top-k request fails an assertion
            in the scheduler). When off, a seeded request's result has
            ``meta["seed_ignored"] = True``.
        initial_version: policy version of the weights the server was started with.
        vocab_size: the policy tokenizer's size (``len(tokenizer)``), or None (unchecked). A
            generated token id ``>= vocab_size`` is an :class:`EngineError` (so that episode is
            an infrastructure failure, not a crash of the run or of the evaluation).
        initial_lora: name of the LoRA adapter the server was started with (``--lora-paths``), which
            requests use until :meth:`SGLangEngine.load_adapter` loads another; None: no adapter.

    Raises:
        ValueError: naming the field and value.
    """

    base_url: str
    request_timeout_s: float = 600.0
    connect_timeout_s: float = 10.0
    max_retries: int = 3
    backoff_s: float = 0.5
    pause_mode: Literal["abort", "retract", "in_place"] = "retract"
    forward_seed: bool = False
    initial_version: int = 0
    vocab_size: int | None = None
    initial_lora: str | None = None

    def __post_init__(self) -> None:
        """Validate every field."""
        def bad(name: str, why: str) -> ValueError:
            return ValueError(f"SGLangEngineConfig.{name}={getattr(self, name)!r}: {why}")

        if not isinstance(self.base_url, str) or not self.base_url.startswith(("http://", "https://")):
            raise bad("base_url", "must be an http(s) URL")
        for name in ("request_timeout_s", "connect_timeout_s"):
            if not getattr(self, name) > 0:
                raise bad(name, "must be > 0 (seconds)")
        if not isinstance(self.max_retries, int) or self.max_retries < 0:
            raise bad("max_retries", "must be an int >= 0")
        if not self.backoff_s >= 0:
            raise bad("backoff_s", "must be >= 0 (seconds)")
        if self.pause_mode not in ("abort", "retract", "in_place"):
            raise bad("pause_mode", "must be 'abort', 'retract' or 'in_place'")
        if not isinstance(self.initial_version, int) or self.initial_version < 0:
            raise bad("initial_version", "must be an int >= 0")
        if self.vocab_size is not None and (not isinstance(self.vocab_size, int) or self.vocab_size < 1):
            raise bad("vocab_size", "must be an int >= 1 or None")


class SGLangEngine:
    """Async :class:`~trainer.engines.base.InferenceEngine` talking to an SGLang server.

    Versions: a request carries the version current when it was admitted. Weight updates
    and :meth:`pause` first close a client-side gate and wait for this client's in-flight
    requests to finish, so every token of a request comes from one version (no updates
    mid-request). LoRA adapter updates (:meth:`load_adapter`) need no gate: each version is an
    adapter of its own name, which a request names when it is admitted.

    Raises:
        EngineError: from every call, after the last retry or on a malformed answer.
    """

    def __init__(self, config: SGLangEngineConfig) -> None:
        """Create the HTTP client (no request is sent)."""
        self.config = config
        self._version = config.initial_version
        self._client = httpx.AsyncClient(
            base_url=config.base_url.rstrip("/"),
            timeout=httpx.Timeout(config.request_timeout_s, connect=config.connect_timeout_s))
        self._cond = asyncio.Condition()
        self._inflight = 0
        self._paused = False
        self._updating = False
        self._update_lock = asyncio.Lock()  # one weight update at a time
        #: the LoRA adapters served (:mod:`.sglang_lora`)
        self.adapters = SGLangAdapters(self._post_checked, self._cond, config.initial_lora)

    @property
    def version(self) -> int:
        """Policy version used for newly admitted requests."""
        return self._version

    # -- HTTP plumbing -----------------------------------------------------------------

    async def _request(self, method: str, path: str, json: Any = None) -> httpx.Response:
        """Send one request, retrying connection errors and 5xx with exponential backoff,
        within ``config.request_timeout_s`` in all (a total deadline: attempts, back-off and
        a slowly trickled answer all count).

        Raises:
            EngineError: 4xx (not retried), the last attempt failed, or the deadline passed;
                the message names the endpoint, the attempts and the last error/answer.
        """
        cfg = self.config
        return await request_with_retries(self._client, method, path, json, label="SGLang",
                                          base_url=cfg.base_url, request_timeout_s=cfg.request_timeout_s,
                                          max_retries=cfg.max_retries, backoff_s=cfg.backoff_s)

    async def _post_json(self, path: str, body: Any) -> Any:
        """POST ``body`` and decode the JSON answer (EngineError if it is not JSON)."""
        resp = await self._request("POST", path, json=body)
        try:
            return resp.json()
        except ValueError as e:
            raise EngineError(f"SGLang POST {path}: answer is not JSON: {resp.text[:300]!r}") from e

    async def _post_checked(self, path: str, body: Any) -> dict:
        """POST to a control endpoint answering ``{"success": bool, "message": str}``."""
        out = await self._post_json(path, body)
        if not isinstance(out, dict) or out.get("success") is not True:
            raise EngineError(f"SGLang POST {path} did not succeed: {out!r}"[:800])
        return out

    # -- the protocol ------------------------------------------------------------------

    async def generate(self, prompt_ids: Sequence[int], params: SamplingParams) -> GenerationResult:
        """Generate from ``prompt_ids`` (see :func:`build_generate_payload`).

        Waits while the engine is paused or updating weights.

        Raises:
            ValueError: bad ``prompt_ids`` / unsupported parameter combination.
            EngineError: HTTP failure after retries or malformed answer.
        """
        payload = build_generate_payload(prompt_ids, params, forward_seed=self.config.forward_seed)
        async with self._cond:
            await self._cond.wait_for(lambda: not self._paused and not self._updating)
            self._inflight += 1
            version, lora = self._version, self.adapters.acquire()
        if lora is not None:
            payload["lora_path"] = lora  # SGLang's per-request adapter (the version's own name)
        try:
            body = await self._post_json("/generate", payload)
        finally:
            async with self._cond:
                self._inflight -= 1
                self.adapters.release(lora)
                self._cond.notify_all()
        result = parse_generate_response(body, version, max_new_tokens=params.max_new_tokens,
                                         vocab_size=self.config.vocab_size)
        if params.seed is not None and not self.config.forward_seed:
            result.meta["seed_ignored"] = True
        return result

    async def _drain(self, flag: str) -> None:
        """Set ``self.<flag>`` (closing the gate) and wait for in-flight requests to end."""
        async with self._cond:
            setattr(self, flag, True)
            await self._cond.wait_for(lambda: self._inflight == 0)

    async def _reopen(self, flag: str) -> None:
        """Clear ``self.<flag>`` and wake waiting requests."""
        async with self._cond:
            setattr(self, flag, False)
            self._cond.notify_all()

    async def update_weights(self, source: object, version: int) -> None:
        """Load a checkpoint directory as policy ``version`` (``/update_weights_from_disk``,
        then ``/flush_cache`` so no KV computed with the old weights is reused).

        Args:
            source: checkpoint directory (str or ``os.PathLike``) readable by the server.
            version: new policy version (int >= 0).

        Raises:
            ValueError: ``source`` is not a path (in-memory state dicts go through
                :meth:`update_weights_from_distributed`) or ``version`` is not an int >= 0.
            EngineError: the server refused or failed; the version is left unchanged.
        """
        if not isinstance(source, (str, os.PathLike)):
            raise ValueError(f"SGLangEngine.update_weights: source={type(source).__name__} must be a "
                             "checkpoint directory path; use update_weights_from_distributed for tensors")
        _check_version(version)
        async with self._update_lock:
            await self._drain("_updating")
            try:
                await self._post_checked("/update_weights_from_disk",
                                         {"model_path": os.fspath(source), "weight_version": str(version)})
                await self.flush_cache()
                self._version = version
            finally:
                await self._reopen("_updating")

    async def load_adapter(self, source: str | os.PathLike, version: int) -> None:
        """Serve the PEFT LoRA adapter directory ``source`` (readable by the server) as policy
        ``version`` (``/load_lora_adapter`` under a name of its own, then new requests carry it as
        ``lora_path``: :class:`~trainer.engines.sglang_lora.SGLangAdapters`). Requests admitted
        before keep the previous adapter and version; nothing is paused or flushed.

        Raises:
            ValueError: ``version`` is not an int >= 0.
            EngineError: the server refused (e.g. started without ``--enable-lora``, a rank above
                ``--max-lora-rank``); the version is left unchanged.
        """
        _check_version(version)
        async with self._update_lock:
            await self.adapters.load(source, version, lambda: setattr(self, "_version", version))

    async def flush_cache(self) -> None:
        """``POST /flush_cache`` (drop the radix/KV prefix cache).

        Raises:
            EngineError: HTTP failure (SGLang answers 400 while requests are running).
        """
        await self._request("POST", "/flush_cache")

    async def pause(self) -> None:
        """Stop admitting requests, wait for this client's in-flight ones, then
        ``POST /pause_generation`` with ``config.pause_mode``."""
        await self._drain("_paused")
        await self._post_json("/pause_generation", {"mode": self.config.pause_mode})

    async def resume(self) -> None:
        """``POST /continue_generation`` and admit requests again."""
        await self._post_json("/continue_generation", {})
        await self._reopen("_paused")

    async def init_weights_update_group(self, master_address: str, master_port: int, rank_offset: int,
                                        world_size: int, group_name: str = "weight_update_group",
                                        backend: str = "nccl") -> None:
        """Have the server's TP workers join a torch.distributed group with the trainer
        (``POST /init_weights_update_group``). The trainer is rank 0; the server's
        workers take ranks ``rank_offset .. rank_offset + tp - 1`` of ``world_size``.
        The trainer must call ``init_process_group`` with the same address/port
        concurrently (this request blocks until the group forms).

        Raises:
            ValueError: bad argument (named). EngineError: the server failed.
        """
        if not isinstance(master_port, int) or not 0 < master_port < 65536:
            raise ValueError(f"master_port={master_port!r}: must be an int in 1..65535")
        if not isinstance(world_size, int) or world_size < 2:
            raise ValueError(f"world_size={world_size!r}: must be an int >= 2 (trainer + server)")
        if not isinstance(rank_offset, int) or not 0 < rank_offset < world_size:
            raise ValueError(f"rank_offset={rank_offset!r}: must be in 1..world_size-1")
        await self._post_checked("/init_weights_update_group", {
            "master_address": master_address, "master_port": master_port, "rank_offset": rank_offset,
            "world_size": world_size, "group_name": group_name, "backend": backend})

    async def update_weights_from_distributed(self, params: Sequence[tuple[str, Any, Sequence[int]]],
                                              version: int, group_name: str = "weight_update_group"
                                              ) -> None:
        """Receive ``params`` by broadcast from trainer rank 0 as policy ``version``
        (``POST /update_weights_from_distributed``, cache flushed by the server).

        The trainer must ``torch.distributed.broadcast`` each tensor, in this order, while
        this request is pending. Requests are drained first, as in :meth:`update_weights`.

        Args:
            params: ``(name, dtype, shape)`` per tensor; dtype a ``torch.dtype`` or its name
                (``"bfloat16"``); shape a sequence of ints.
            version: new policy version.

        Raises:
            ValueError: empty/misaligned ``params`` (named). EngineError: the server failed.
        """
        _check_version(version)
        if not params:
            raise ValueError("update_weights_from_distributed: params is empty")
        names, dtypes, shapes = [], [], []
        for i, p in enumerate(params):
            if not isinstance(p, (tuple, list)) or len(p) != 3 or not isinstance(p[0], str):
                raise ValueError(f"params[{i}]={p!r}: must be (name, dtype, shape)")
            name, dtype, shape = p
            dtype_name = str(dtype).removeprefix("torch.")
            if not dtype_name or not all(isinstance(s, int) and s >= 0 for s in shape):
                raise ValueError(f"params[{i}]={p!r}: dtype must be named and shape must be ints >= 0")
            names.append(name)
            dtypes.append(dtype_name)
            shapes.append([int(s) for s in shape])
        async with self._update_lock:
            await self._drain("_updating")
            try:
                await self._post_checked("/update_weights_from_distributed", {
                    "names": names, "dtypes": dtypes, "shapes": shapes, "group_name": group_name,
                    "flush_cache": True, "weight_version": str(version)})
                self._version = version
            finally:
                await self._reopen("_updating")

    async def destroy_weights_update_group(self, group_name: str = "weight_update_group") -> None:
        """``POST /destroy_weights_update_group``. Raises EngineError if it fails."""
        await self._post_checked("/destroy_weights_update_group", {"group_name": group_name})

    async def server_info(self) -> dict:
        """``GET /server_info`` (``/get_server_info`` on older servers), checking the version.

        Raises:
            EngineError: unreachable, or SGLang older than :data:`MIN_SGLANG_VERSION`.
        """
        try:
            info = (await self._request("GET", "/server_info")).json()
        except EngineError:
            info = (await self._request("GET", "/get_server_info")).json()
        version = str(info.get("version", "0")) if isinstance(info, dict) else "0"
        m = re.match(r"(\d+)\.(\d+)\.(\d+)", version)
        if m is None or tuple(int(x) for x in m.groups()) < MIN_SGLANG_VERSION:
            raise EngineError(f"SGLang version {version} < {'.'.join(map(str, MIN_SGLANG_VERSION))}: its "
                              "log-probs are top-p renormalised, not the learner's convention")
        return info

    async def close(self) -> None:
        """Finish pending adapter unloads, close the HTTP client (the server is owned by
        :class:`SGLangLauncher`)."""
        await self.adapters.close()
        await self._client.aclose()


def _check_version(version: object) -> None:
    """Raise ValueError unless ``version`` is an int >= 0."""
    if isinstance(version, bool) or not isinstance(version, int) or version < 0:
        raise ValueError(f"version={version!r}: must be an int >= 0")
