"""Start and stop an SGLang HTTP server (``python -m sglang.launch_server``) as a subprocess.

The server runs in its own process group (session) so that :meth:`SGLangLauncher.close`
can end it together with the scheduler/detokenizer processes it forks. Close runs on
``close()``, on leaving the context manager, when the launcher is garbage-collected and
at interpreter exit (``weakref.finalize``), so no server is left behind as an orphan.

Flags follow SGLang's ``server_args`` (https://docs.sglang.io/advanced_features/server_arguments.html).
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field
from typing import Literal

from .server_launcher import ServerLauncher, ServerLaunchError, free_port

__all__ = ["FORBIDDEN_ENV", "SGLangLaunchError", "SGLangLauncher", "SGLangLauncherConfig", "build_command",
           "free_port"]

#: Server environment variables that would change which distribution SGLang reports
#: log-probs under (``SGLANG_RETURN_ORIGINAL_LOGPROB=1``: ``log_softmax(logits)`` at T=1,
#: ignoring temperature). The launcher removes them; setting them is a config error.
FORBIDDEN_ENV = ("SGLANG_RETURN_ORIGINAL_LOGPROB", "RETURN_ORIGINAL_LOGPROB")

_DTYPES = ("auto", "half", "float16", "bfloat16", "float", "float32")
_SAMPLING_BACKENDS = ("flashinfer", "pytorch")


class SGLangLaunchError(ServerLaunchError):
    """The SGLang server exited during start-up or did not become healthy in time.

    The message carries the exit status (if any) and the tail of the server log.
    """


@dataclass(frozen=True)
class SGLangLauncherConfig:
    """How to launch one SGLang server (validated on construction).

    Attributes:
        model_path: local checkpoint directory (``save_pretrained`` layout); checked to
            exist when the server starts (no downloads at run time).
        host: interface to bind; loopback by default.
        port: TCP port; ``None`` picks a free one.
        tp: tensor-parallel size (GPUs), >= 1 (``--tp-size``).
        dp: data-parallel replicas behind the one endpoint, >= 1 (``--dp-size``; the server
            uses ``tp × dp`` GPUs).
        base_gpu_id: first GPU index the server uses, >= 0 (``--base-gpu-id``), so rollouts can
            take GPUs the learner's ranks do not (learner on 0..3, SGLang from 4).
        mem_fraction_static: fraction of GPU memory for weights + KV cache, in (0, 1).
        dtype: ``--dtype`` (``auto``, ``half``, ``float16``, ``bfloat16``, ``float``,
            ``float32``); ``None`` leaves SGLang's default.
        random_seed: ``--random-seed`` (server RNG), >= 0; ``None`` leaves the default.
        sampling_backend: ``--sampling-backend`` (``flashinfer`` or ``pytorch``; per-request
            seeds with top-p/top-k need ``pytorch``); ``None`` leaves the default.
        attention_backend: ``--attention-backend`` (e.g. ``triton``, ``torch_native``).
        lora_max_rank: serve LoRA adapters up to this rank (``--enable-lora --max-lora-rank``);
            None: no LoRA.
        lora_target_modules: the modules adapters may adapt (``--lora-target-modules``; ``all``:
            every supported one); needed with ``lora_max_rank``.
        lora_paths: adapters loaded at start-up, ``NAME=DIR`` each (``--lora-paths``).
        max_loras_per_batch: adapters one batch may mix (``--max-loras-per-batch``): 2 lets requests
            of the previous policy version finish next to those of the new one.
        extra_args: further command-line arguments, appended verbatim.
        extra_env: environment variables added for the server process.
        python: interpreter that runs ``-m sglang.launch_server``.
        health_path: ``/health`` (server up) or ``/health_generate`` (one token generated).
        startup_timeout_s: seconds to wait for a healthy server.
        poll_interval_s: seconds between health polls.
        shutdown_grace_s: seconds between SIGTERM and SIGKILL of the process group.
        log_path: file receiving the server's stdout+stderr; ``None``: a temporary file.
        log_tail_lines: lines of the log quoted in :class:`SGLangLaunchError`.
        show_progress: show a tqdm bar while waiting for the server.

    Raises:
        ValueError: naming the field and value.
    """

    model_path: str
    host: str = "127.0.0.1"
    port: int | None = None
    tp: int = 1
    dp: int = 1
    base_gpu_id: int = 0
    mem_fraction_static: float = 0.8
    dtype: str | None = None
    random_seed: int | None = None
    sampling_backend: str | None = None
    attention_backend: str | None = None
    lora_max_rank: int | None = None
    lora_target_modules: tuple[str, ...] = ()
    lora_paths: tuple[str, ...] = ()
    max_loras_per_batch: int = 2
    extra_args: tuple[str, ...] = ()
    extra_env: dict[str, str] = field(default_factory=dict)
    python: str = sys.executable
    health_path: Literal["/health", "/health_generate"] = "/health"
    startup_timeout_s: float = 900.0
    poll_interval_s: float = 1.0
    shutdown_grace_s: float = 15.0
    log_path: str | None = None
    log_tail_lines: int = 60
    show_progress: bool = True

    def __post_init__(self) -> None:
        """Validate every field."""
        def bad(name: str, why: str) -> ValueError:
            return ValueError(f"SGLangLauncherConfig.{name}={getattr(self, name)!r}: {why}")

        if not isinstance(self.model_path, str) or not self.model_path:
            raise bad("model_path", "must be a non-empty path string")
        if not isinstance(self.host, str) or not self.host:
            raise bad("host", "must be a non-empty host name")
        if self.port is not None and (not isinstance(self.port, int) or not 0 < self.port < 65536):
            raise bad("port", "must be None or an int in 1..65535")
        if not isinstance(self.tp, int) or self.tp < 1:
            raise bad("tp", "must be an int >= 1")
        if not isinstance(self.dp, int) or self.dp < 1:
            raise bad("dp", "must be an int >= 1")
        if not isinstance(self.base_gpu_id, int) or self.base_gpu_id < 0:
            raise bad("base_gpu_id", "must be an int >= 0")
        if not 0 < self.mem_fraction_static < 1:
            raise bad("mem_fraction_static", "must be in (0, 1)")
        if self.dtype is not None and self.dtype not in _DTYPES:
            raise bad("dtype", f"must be None or one of {_DTYPES}")
        if self.random_seed is not None and (not isinstance(self.random_seed, int) or self.random_seed < 0):
            raise bad("random_seed", "must be None or an int >= 0")
        if self.sampling_backend is not None and self.sampling_backend not in _SAMPLING_BACKENDS:
            raise bad("sampling_backend", f"must be None or one of {_SAMPLING_BACKENDS}")
        if self.lora_max_rank is not None:
            if isinstance(self.lora_max_rank, bool) or not isinstance(self.lora_max_rank, int) \
                    or self.lora_max_rank < 1:
                raise bad("lora_max_rank", "must be None or an int >= 1")
            if isinstance(self.lora_target_modules, str) or not self.lora_target_modules:
                raise bad("lora_target_modules", "must name the adapted modules when lora_max_rank is set")
        elif self.lora_target_modules or self.lora_paths:
            raise bad("lora_max_rank", "must be set (an int >= 1) with lora_target_modules / lora_paths")
        if not all(isinstance(p, str) and "=" in p for p in self.lora_paths):
            raise bad("lora_paths", "must be NAME=DIR strings")
        if not isinstance(self.max_loras_per_batch, int) or self.max_loras_per_batch < 1:
            raise bad("max_loras_per_batch", "must be an int >= 1")
        if isinstance(self.extra_args, str) or not all(isinstance(a, str) for a in self.extra_args):
            raise bad("extra_args", "must be a tuple of strings")
        if not all(isinstance(k, str) and isinstance(v, str) for k, v in self.extra_env.items()):
            raise bad("extra_env", "must map str to str")
        forbidden = sorted(set(self.extra_env) & set(FORBIDDEN_ENV))
        if forbidden:
            raise bad("extra_env", f"must not set {forbidden}: it makes SGLang report log-probs "
                                   "without temperature, breaking the learner's log-prob convention")
        if self.health_path not in ("/health", "/health_generate"):
            raise bad("health_path", "must be '/health' or '/health_generate'")
        for name in ("startup_timeout_s", "poll_interval_s", "shutdown_grace_s"):
            if not getattr(self, name) > 0:
                raise bad(name, "must be > 0 (seconds)")
        if not isinstance(self.log_tail_lines, int) or self.log_tail_lines < 1:
            raise bad("log_tail_lines", "must be an int >= 1")


def build_command(cfg: SGLangLauncherConfig, port: int) -> list[str]:
    """The ``argv`` that starts the server described by ``cfg`` on ``port``.

    Returns:
        ``[python, "-m", "sglang.launch_server", "--model-path", ..., "--host", ...,
        "--port", ..., "--tp-size", ..., "--mem-fraction-static", ..., (optional flags; with
        ``lora_max_rank``: "--enable-lora", "--max-lora-rank", R, "--lora-target-modules", ...,
        "--max-loras-per-batch", N[, "--lora-paths", ...]), *extra_args]``.
    """
    cmd = [cfg.python, "-m", "sglang.launch_server",
           "--model-path", cfg.model_path,
           "--host", cfg.host,
           "--port", str(port),
           "--tp-size", str(cfg.tp),
           "--mem-fraction-static", repr(float(cfg.mem_fraction_static))]
    if cfg.dp != 1:
        cmd += ["--dp-size", str(cfg.dp)]
    if cfg.base_gpu_id:
        cmd += ["--base-gpu-id", str(cfg.base_gpu_id)]
    if cfg.dtype is not None:
        cmd += ["--dtype", cfg.dtype]
    if cfg.random_seed is not None:
        cmd += ["--random-seed", str(cfg.random_seed)]
    if cfg.sampling_backend is not None:
        cmd += ["--sampling-backend", cfg.sampling_backend]
    if cfg.attention_backend is not None:
        cmd += ["--attention-backend", cfg.attention_backend]
    if cfg.lora_max_rank is not None:
        cmd += ["--enable-lora", "--max-lora-rank", str(cfg.lora_max_rank),
                "--lora-target-modules", *cfg.lora_target_modules,
                "--max-loras-per-batch", str(cfg.max_loras_per_batch)]
        if cfg.lora_paths:
            cmd += ["--lora-paths", *cfg.lora_paths]
    return cmd + list(cfg.extra_args)


class SGLangLauncher(ServerLauncher):
    """Runs one SGLang server subprocess (:class:`~trainer.engines.server_launcher.ServerLauncher`:
    its own process group, health poll, log tail, killed on close / exit / garbage collection);
    use as a context manager.

    Example::

        with SGLangLauncher(SGLangLauncherConfig(model_path="/ckpt/qwen3-4b")) as server:
            engine = SGLangEngine(SGLangEngineConfig(base_url=server.url))

    Raises:
        SGLangLaunchError: from :meth:`start` if the server dies or times out.
    """

    label = "SGLang server"
    error_cls = SGLangLaunchError
    log_prefix = "sglang-server-"
    config: SGLangLauncherConfig

    def build_argv(self, port: int) -> list[str]:
        """:func:`build_command` of this launcher's config."""
        return build_command(self.config, port)

    def build_env(self) -> dict[str, str]:
        """This process's environment without :data:`FORBIDDEN_ENV`, plus ``extra_env``."""
        env = {k: v for k, v in os.environ.items() if k not in FORBIDDEN_ENV}
        env.update(self.config.extra_env)
        return env

    def start(self) -> SGLangLauncher:
        """Start the server and wait until ``health_path`` answers 200 (see
        :meth:`ServerLauncher.start`).

        Returns:
            self.

        Raises:
            ValueError: ``model_path`` is not a directory. RuntimeError: already started.
            SGLangLaunchError: the process exited or stayed unhealthy (with the log's tail).
        """
        super().start()
        return self

    def __enter__(self) -> SGLangLauncher:
        """Start the server (see :meth:`start`)."""
        return self.start()
