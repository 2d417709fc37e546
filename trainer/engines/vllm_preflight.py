"""The ``vllm`` engine's preflight: what can be refused before any work (no server started, no
model loaded), in one line naming the key: a sampling setting under which vLLM's log-probs are not
the learner's convention (greedy at a temperature other than 1), a missing server virtualenv, a
server to attach to under the Ray launcher, and too few adapters kept for a fixed lag.
"""

from __future__ import annotations

import os

from ..errors import ConfigError
from .registry import EngineCheck
from .vllm_factory import adapters_kept
from .vllm_launcher import DEFAULT_VLLM_PYTHON, SETUP_HINT
from .vllm_protocol import check_sampling


def vllm_preflight(check: EngineCheck) -> None:
    """Refuse a run the ``vllm`` engine cannot serve exactly (registered as its ``preflight``).

    Args:
        check: the run's :class:`~trainer.engines.registry.EngineCheck` (``settings`` a
            :class:`~trainer.engines.vllm_factory.VLLMSettings` or None for the defaults).

    Raises:
        ConfigError: greedy ``rollout.top_k = 1`` at a temperature other than 1
            (:func:`~.vllm_protocol.check_sampling`; top-k / top-p sampling is served: its processed
            log-probs are the truncated ones the learner replays); ``url`` (attach to a running
            server) with the Ray launcher; no interpreter at ``rollout.engine_settings.python``
            when a server is to be launched (naming ``scripts/setup.sh --vllm``);
            ``keep_adapters`` below ``k + 1`` for a LoRA policy under a fixed lag ``k`` (the adapter
            of a version still generating would be unloaded), or ``max_loras`` below the adapters
            kept (:func:`~.vllm_factory.adapters_kept`).
    """
    try:
        check_sampling(check.sampling)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    url = getattr(check.settings, "url", "")
    if url and check.rollout_workers:
        raise ConfigError(f"rollout.engine_settings.url={url} with launcher.kind={check.launcher}: each Ray "
                          "rollout worker launches its own server; attach to a running server with "
                          "launcher.kind=local, or leave url empty")
    python = getattr(check.settings, "python", None) or DEFAULT_VLLM_PYTHON
    if not url and not os.access(python, os.X_OK):
        raise ConfigError(f"rollout.engine_settings.python={python!r}: no vLLM interpreter there (the "
                          f"server's own virtualenv); {SETUP_HINT}")
    keep = getattr(check.settings, "keep_adapters", 0)
    need = None if check.fixed_lag is None else check.fixed_lag + 1
    if check.lora and need is not None and keep and keep < need:
        raise ConfigError(f"rollout.engine_settings.keep_adapters={keep} with train.staleness fixed lag "
                          f"{check.fixed_lag}: the adapters of {need} policy versions must stay loaded; "
                          f"set keep_adapters >= {need} (or 0: derived)")
    if check.lora and check.settings is not None:
        try:
            adapters_kept(check.settings, check.fixed_lag)
        except ValueError as e:
            raise ConfigError(str(e)) from None
