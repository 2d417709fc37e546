"""Attach the ``vllm`` engine to a server that is already running (``rollout.engine_settings.url``)
instead of launching one: prime-rl's and SkyRL's "remote inference server" mode (a server started
once, on another port or by another tool, and used by many runs).

The run does not own the server, so before anything is sent :func:`attach` checks that it is one
this run can use, each failure one line naming ``rollout.engine_settings.url`` and quoting the
command line that starts a suitable server (:func:`server_command`):

- it answers ``GET /v1/models`` and serves the base model as ``policy`` (``--served-model-name``)
  from ``model.path`` itself (its ``root``, paths compared resolved);
- its ``max_model_len`` is at least ``rollout.engine_settings.max_model_len``;
- a full-weight or merged-LoRA run (weights reloaded in place) finds our worker extension behind
  ``/collective_rpc`` (``copc_ping``; the server needs ``VLLM_SERVER_DEV_MODE=1`` and
  ``--worker-extension-cls``).

What cannot be read from the API is caught by the run itself: the log-prob convention
(``--logprobs-mode processed_logprobs``) and weights left in the server by another run are checked
by the sync attestation's start-up check (:meth:`~trainer.orchestration.attestation.SyncAttestor.startup`),
before any episode; a LoRA run on a server without runtime LoRA fails its first adapter load in one
line. A run leaves the server as it found it where it can: its LoRA adapters carry a name unique to
the run (:func:`run_adapter_prefix`) and are unloaded when the engine closes. Where the server runs
the worker extension, every run reloads its start weights when it attaches (``model.path``'s, or a
resumed full fine-tune's), so a server another run left on its last version serves the right base;
a full-weight run leaves its last version in the server.
"""

from __future__ import annotations

import secrets
import shlex
from pathlib import Path

import httpx

from ..errors import ConfigError
from .sglang_lora import ADAPTER_PREFIX
from .vllm_launcher import VLLMLauncher, VLLMLauncherConfig, VLLMLaunchError

#: The worker-extension method that answers whether it is installed (``vllm_ext/copc_vllm_ext.py``).
PING_METHOD = "copc_ping"


class AttachError(VLLMLaunchError, ConfigError):
    """The server at ``rollout.engine_settings.url`` cannot serve this run (one line naming the key):
    a :class:`~trainer.errors.ConfigError`, so ``copc train`` / ``copc eval`` print it as a
    configuration error and exit 2, and a :class:`~.vllm_launcher.VLLMLaunchError`."""


def run_adapter_prefix() -> str:
    """A prefix for the adapter names of one run on a shared server (``copc-<6 hex>-``), so two runs
    attached to one server never load or unload each other's adapters."""
    return f"{ADAPTER_PREFIX}{secrets.token_hex(3)}-"


def server_command(cfg: VLLMLauncherConfig) -> str:
    """The shell command (environment and ``argv``) that starts a server this run could attach to:
    what :class:`~.vllm_launcher.VLLMLauncher` would run, with ``PORT`` for the port."""
    launcher = VLLMLauncher(cfg)
    env = launcher.build_env()
    keys = ("VLLM_CPU_KVCACHE_SPACE", "VLLM_ALLOW_RUNTIME_LORA_UPDATING", "VLLM_SERVER_DEV_MODE",
            "PYTHONPATH")
    words = [f"{k}={shlex.quote(env[k])}" for k in keys if k in env]
    argv = launcher.build_argv(0)
    words += ["PORT" if a == "0" and prev == "--port" else shlex.quote(a)
              for prev, a in zip(["", *argv[:-1]], argv, strict=True)]
    return " ".join(words)


class AttachedServer:
    """A vLLM server this run did not start (what the factories hold where they would hold a
    :class:`~.vllm_launcher.VLLMLauncher`).

    Attributes:
        url: its base URL, without a trailing slash.
        reloadable: it runs COPC's worker extension (weights can be reloaded in place).
        proc: None (no process of ours). log_path: None (its log is not ours).
    """

    proc = None
    log_path = None

    def __init__(self, url: str) -> None:
        self.url = url.rstrip("/")
        self.reloadable = False

    def close(self) -> None:
        """Nothing: the server keeps running (the engine unloads its adapters before)."""


def attach(url: str, cfg: VLLMLauncherConfig, timeout_s: float = 30.0) -> AttachedServer:
    """Check that the server at ``url`` can serve the run that would launch ``cfg`` (module docstring).

    Args:
        url: ``rollout.engine_settings.url``.
        cfg: the launcher config the run would use (its model path, ``max_model_len``, whether
            weights are reloaded in place).
        timeout_s: seconds each check's request may take.

    Returns:
        The attached server.

    Raises:
        AttachError: one line naming ``rollout.engine_settings.url`` and what is wrong, with the
            command that starts a suitable server.
    """
    server = AttachedServer(url)
    field = f"rollout.engine_settings.url={url}"
    hint = f"; start one with: {server_command(cfg)}"
    try:
        r = httpx.get(server.url + "/v1/models", timeout=timeout_s)
        models = r.json().get("data") if r.status_code == 200 else None
    except (httpx.HTTPError, ValueError) as e:
        raise AttachError(f"{field}: no vLLM server answers ({type(e).__name__}: {e}){hint}") from None
    if not isinstance(models, list):
        root = " (the url is the server's root, without /v1)" if r.status_code == 404 else ""
        raise AttachError(f"{field}: GET /v1/models -> HTTP {r.status_code}, not a vLLM model list{root}"
                          f"{hint}")
    base = next((m for m in models if isinstance(m, dict) and m.get("id") == cfg.served_model_name
                 and not m.get("parent")), None)
    if base is None:
        names = sorted(str(m.get("id")) for m in models if isinstance(m, dict))
        raise AttachError(f"{field}: serves {names}, not a base model named {cfg.served_model_name!r} "
                              f"(--served-model-name){hint}")
    if Path(str(base.get("root"))).resolve() != Path(cfg.model_path).resolve():
        raise AttachError(f"{field}: serves {base.get('root')}, but this run's model is {cfg.model_path}"
                              f"{hint}")
    if not isinstance(base.get("max_model_len"), int) or base["max_model_len"] < cfg.max_model_len:
        raise AttachError(f"{field}: its max_model_len is {base.get('max_model_len')}, below "
                              f"rollout.engine_settings.max_model_len={cfg.max_model_len}{hint}")
    try:
        r = httpx.post(server.url + "/collective_rpc", json={"method": PING_METHOD}, timeout=timeout_s)
        server.reloadable = r.status_code == 200 and all(x == {"copc": True}
                                                         for x in r.json().get("results") or [None])
    except (httpx.HTTPError, ValueError):
        server.reloadable = False
    if cfg.reload_weights and not server.reloadable:
        raise AttachError(f"{field}: cannot reload weights in place (no /collective_rpc with COPC's "
                              f"worker extension: a full-weight or merged-LoRA run needs "
                              f"VLLM_SERVER_DEV_MODE=1 and --worker-extension-cls){hint}")
    return server


def start_or_attach(url: str, cfg: VLLMLauncherConfig) -> VLLMLauncher | AttachedServer:
    """The server of a run: attached at ``url`` (:func:`attach`), or with ``url`` empty launched from
    ``cfg`` (:meth:`~.vllm_launcher.VLLMLauncher.start`).

    Raises:
        VLLMLaunchError: the server cannot be attached to, or cannot start (with its log's tail).
    """
    return attach(url, cfg) if url else VLLMLauncher(cfg).start()
