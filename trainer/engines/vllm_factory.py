"""The ``vllm`` engine's settings (:class:`VLLMSettings`, ``rollout.engine_settings`` with
``rollout.engine: vllm``) and factory (:func:`vllm_engine`): a vLLM server launched from ``.venv-vllm``
and an HTTP client for it, weights synced as one LoRA adapter per policy version (a policy without
LoRA: full weights reloaded in place, :mod:`.vllm_full_sync`).

Registering costs nothing: the launcher and the client are imported inside the factory.
"""

from __future__ import annotations

import asyncio
import shutil
from dataclasses import dataclass
from typing import TYPE_CHECKING

from .registry import EngineHandle, EngineSpec, Weights
from .vllm_full_sync import reload_now, vllm_full_weight_engine
from .vllm_launcher import DEFAULT_VLLM_PYTHON

if TYPE_CHECKING:
    from ..models.lora import AdapterWeights

_DTYPES = ("float32", "bfloat16", "float16")


@dataclass(frozen=True)
class VLLMSettings:
    """The ``vllm`` engine's own settings.

    Attributes:
        url: a running server to attach to (``http://host:port``) instead of launching one
            (:mod:`.vllm_attach`: it must serve ``model.path`` as ``policy``; empty: launch).
        port: the server's port on 127.0.0.1 (0: a free one).
        python: the interpreter with vLLM (default: ``.venv-vllm`` of this checkout, made by
            ``bash scripts/setup.sh --vllm``).
        max_model_len: the longest prompt + completion in tokens.
        kv_cache_gib: whole GiB of KV cache (``VLLM_CPU_KVCACHE_SPACE`` on CPU; an int >= 1).
        enforce_eager: skip vLLM's compile (``--enforce-eager``: ~77 s start on 2 cores instead of 3.5-6 min).
        dtype: ``float32`` (default; bf16 log-probs are off by up to 0.17 nats), ``bfloat16``, ``float16``.
        max_loras: adapters one batch may mix (0: the adapters kept; else >= them).
        max_lora_rank: the largest adapter rank served (0: the policy adapter's rank).
        keep_adapters: policy versions' adapters kept loaded (0: derived from the run's staleness,
            :func:`adapters_kept`: k + 1 under a fixed lag k, else 2; set: >= k + 1).
        lora_sync: how a LoRA policy reaches the server: ``adapter`` (one runtime LoRA adapter per
            version, no pause) or ``merged`` (each version merged into the base weights and
            reloaded in place, requests drained: ~5x faster decoding on a CPU,
            :mod:`.vllm_merged`).
        startup_timeout_s: seconds to wait for a healthy server.
        log_tail_lines: lines of the server log quoted when it cannot start.
        request_timeout_s: deadline of one request, retries included. max_retries: retries of a
            connection error or 5xx answer.

    Raises:
        ValueError: a value out of range, in one line naming the field.
    """

    url: str = ""
    port: int = 0
    python: str = DEFAULT_VLLM_PYTHON
    max_model_len: int = 4096
    kv_cache_gib: int = 1
    enforce_eager: bool = False
    dtype: str = "float32"
    max_loras: int = 0
    max_lora_rank: int = 0
    keep_adapters: int = 0
    lora_sync: str = "adapter"
    startup_timeout_s: float = 900.0
    log_tail_lines: int = 40
    request_timeout_s: float = 600.0
    max_retries: int = 3

    def __post_init__(self) -> None:
        def is_int(v: object) -> bool:
            return isinstance(v, int) and not isinstance(v, bool)

        if not isinstance(self.url, str) or (self.url and not self.url.startswith(("http://", "https://"))):
            raise ValueError(f"url={self.url!r}: must be empty (launch a server) or an http(s) URL")
        if not is_int(self.port) or not 0 <= self.port <= 65535:
            raise ValueError(f"port={self.port!r}: must be 0 (a free port) or in 1..65535")
        if not isinstance(self.python, str) or not self.python:
            raise ValueError(f"python={self.python!r}: must be the path of the vLLM venv's interpreter")
        for k in ("max_model_len", "kv_cache_gib", "log_tail_lines"):
            if not is_int(getattr(self, k)) or getattr(self, k) < 1:
                raise ValueError(f"{k}={getattr(self, k)!r}: must be an int >= 1")
        for k in ("max_loras", "keep_adapters", "max_lora_rank", "max_retries"):
            if not is_int(getattr(self, k)) or getattr(self, k) < 0:
                raise ValueError(f"{k}={getattr(self, k)!r}: must be an int >= 0")
        for k in ("startup_timeout_s", "request_timeout_s"):
            if isinstance(getattr(self, k), bool) or not getattr(self, k) > 0:
                raise ValueError(f"{k}={getattr(self, k)!r}: must be > 0")
        if not isinstance(self.enforce_eager, bool):
            raise ValueError(f"enforce_eager={self.enforce_eager!r}: must be true or false")
        if self.lora_sync not in ("adapter", "merged"):
            raise ValueError(f"lora_sync={self.lora_sync!r}: must be adapter or merged")
        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype={self.dtype!r}: must be one of {', '.join(_DTYPES)}")
        if 0 < self.max_loras < self.keep_adapters:
            raise ValueError(f"max_loras={self.max_loras!r}: must be >= keep_adapters={self.keep_adapters}")


def adapters_kept(settings: VLLMSettings, fixed_lag: int | None) -> tuple[int, int]:
    """``(keep_adapters, max_loras)`` of a run: the settings' values, or where they are 0 the
    derived ones: under a fixed lag ``k`` the k + 1 versions a batch may still be generated with
    (spec §staleness: batch n comes from version n − k while the learner makes n + 1), else 2 (the
    current version and the previous one, whose requests may still be in flight at a sync);
    ``max_loras`` 0: as many as are kept.

    Raises:
        ValueError: a set ``max_loras`` below the adapters kept (the preflight says it first).
    """
    keep = settings.keep_adapters or (fixed_lag + 1 if fixed_lag is not None else 2)
    max_loras = settings.max_loras or keep
    if max_loras < keep:
        raise ValueError(f"rollout.engine_settings.max_loras={max_loras}: must be >= the {keep} "
                         "adapters kept (keep_adapters)")
    return keep, max_loras


def vllm_engine(spec: EngineSpec) -> EngineHandle:
    """A vLLM server launched from ``settings.python`` (its own process group), or the one at
    ``settings.url`` (:mod:`.vllm_attach`), and an HTTP client.

    The server serves ``model_dir`` with LoRA enabled and the initial adapter
    (``work_dir/vllm_adapters/v<N>``, PEFT layout) loaded under a name carrying its version; each
    ``sync_adapter`` writes the new adapter there and loads it; the oldest beyond those kept
    (:func:`adapters_kept`) are unloaded (once no request uses them) and their directories removed.
    Without an adapter: :func:`~.vllm_full_sync.vllm_full_weight_engine` (full weights, reloaded in
    place); with ``lora_sync: merged``: :func:`~.vllm_merged.vllm_merged_lora_engine`.

    Raises:
        ValueError: a LoRA adapter with initial weights other than ``model_dir``'s.
        VLLMLaunchError: the venv is missing or the server cannot start (with its log's tail);
            :class:`~.vllm_attach.AttachError` (also a ConfigError): the server at ``settings.url``
            cannot serve this run.
        EngineError: the server refused the initial adapter.
    """
    import httpx

    from .base import EngineError
    from .sglang_lora import ADAPTER_PREFIX, adapter_name
    from .vllm import VLLMEngine, VLLMEngineConfig
    from .vllm_attach import AttachError, run_adapter_prefix, start_or_attach
    from .vllm_launcher import VLLMLauncherConfig

    s: VLLMSettings = spec.settings
    if spec.adapter is None:
        return vllm_full_weight_engine(spec)
    if s.lora_sync == "merged":
        from .vllm_merged import vllm_merged_lora_engine

        return vllm_merged_lora_engine(spec)
    if spec.weights is not None:
        raise ValueError("rollout.engine=vllm serves model.path's base weights with LoRA adapters; "
                         "initial full weights (a resumed full fine-tune) are not supported")
    a = spec.adapter
    keep, max_loras = adapters_kept(s, spec.fixed_lag)
    root = (spec.work_dir or spec.model_dir.parent) / "vllm_adapters"
    launcher = start_or_attach(s.url, VLLMLauncherConfig(
        model_path=str(spec.model_dir), python=s.python, port=s.port or None, dtype=s.dtype,
        max_model_len=s.max_model_len, kv_cache_gib=s.kv_cache_gib, enforce_eager=s.enforce_eager,
        max_lora_rank=s.max_lora_rank or a.settings.rank, max_loras=max_loras,
        startup_timeout_s=s.startup_timeout_s, log_tail_lines=s.log_tail_lines,
        log_path=str(root.parent / "vllm_server.log")))
    prefix = run_adapter_prefix() if s.url else ADAPTER_PREFIX  # a shared server: names of this run
    try:
        if getattr(launcher, "reloadable", False):  # an attached server another run may have changed
            reload_now(VLLMEngineConfig(base_url=launcher.url, request_timeout_s=s.request_timeout_s,
                                        max_retries=s.max_retries), spec.model_dir, spec.version)
        first = adapter_name(0, spec.version, prefix)
        d0 = a.save_peft_dir(root / f"v{spec.version}", spec.model_dir)
        with httpx.Client(base_url=launcher.url, timeout=120.0) as c:  # the factory has no event loop
            r = c.post("/v1/load_lora_adapter", json={"lora_name": first, "lora_path": str(d0)})
        if r.status_code != 200:
            what = (f"vLLM POST /v1/load_lora_adapter (initial adapter {first}) -> HTTP {r.status_code}: "
                    f"{r.text[:300]}").replace("\n", " ")
            if s.url:
                raise AttachError(f"rollout.engine_settings.url={s.url}: {what} (an attached server needs "
                                  "--enable-lora, --max-lora-rank >= the adapter's rank and "
                                  "VLLM_ALLOW_RUNTIME_LORA_UPDATING=True)")
            raise EngineError(what)
    except BaseException:
        launcher.close()
        raise
    dirs: dict[str, object] = {first: d0}

    def forget(name: str) -> None:
        d = dirs.pop(name, None)
        if d is not None:
            shutil.rmtree(d, ignore_errors=True)

    engine = VLLMEngine(VLLMEngineConfig(base_url=launcher.url, request_timeout_s=s.request_timeout_s,
                                         max_retries=s.max_retries, vocab_size=len(spec.tokenizer),
                                         keep_adapters=keep, initial_lora=first,
                                         initial_version=spec.version, adapter_prefix=prefix,
                                         unload_on_close=bool(s.url)), on_unloaded=forget)
    engine.launcher = launcher  # the server process (tests end it to check the client's error)

    async def sync_adapter(adapter: AdapterWeights, version: int) -> None:
        d = await asyncio.to_thread(adapter.save_peft_dir, root / f"v{version}", spec.model_dir)
        dirs[await engine.load_adapter(d, version)] = d

    async def sync(weights: Weights, version: int) -> None:
        await engine.update_weights(weights, version)

    async def close() -> None:
        await engine.close()
        await asyncio.to_thread(launcher.close)

    return EngineHandle(engine, sync, close, sync_adapter=sync_adapter)
