"""Typed specs built from the experiment config where a run is assembled.

A component below the config layer (an engine, a learner backend) never reads the experiment
config: its factory gets a typed spec holding what it needs, built here, once, from the config's
sections and the component's own registered settings (:func:`trainer.plugins.plugin_settings`).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..engines.registry import ENGINES, EngineSpec, Weights
from ..errors import ConfigError
from ..plugins import plugin_settings
from ..rollout.agent_loop import AgentLoopConfig

if TYPE_CHECKING:  # typing only: the config package imports this module
    from . import ExperimentConfig


def engine_spec(cfg: ExperimentConfig, model_dir: Path | str, tokenizer: Any, *, version: int = 0,
                weights: Weights | None = None, work_dir: Path | None = None,
                adapter: Any = None) -> EngineSpec:
    """The :class:`~trainer.engines.registry.EngineSpec` of ``cfg.rollout.engine``.

    Args:
        cfg: the validated experiment config (``model.dtype``, ``model.attn_implementation``,
            ``rollout.engine_max_batch_size`` and the engine's ``rollout.engine_settings`` are read).
        model_dir, tokenizer, version, weights, work_dir, adapter: as the spec's fields.

    Raises:
        ConfigError: bad ``rollout.engine_settings`` (one line naming the key).
    """
    return EngineSpec(model_dir=Path(model_dir), tokenizer=tokenizer, version=version, weights=weights,
                      work_dir=work_dir, adapter=adapter, settings=plugin_settings(cfg, "rollout.engine"),
                      dtype=cfg.model.dtype, attn_implementation=cfg.model.attn_implementation,
                      max_batch_size=cfg.rollout.engine_max_batch_size)


def preflight_engine(cfg: ExperimentConfig) -> None:
    """Run the preflight check ``cfg.rollout.engine`` was registered with (no-op without one).

    Raises:
        ConfigError: unknown engine (naming ``rollout.engine`` and the registered ones), or from
            the check (e.g. SGLang without a GPU).
    """
    try:
        check = ENGINES.metadata(cfg.rollout.engine)["preflight"]
    except KeyError as e:  # RegistryError: one line naming rollout.engine
        raise ConfigError(str(e)) from None
    if check is not None:
        check(cfg)


def agent_loop_config(cfg: ExperimentConfig) -> AgentLoopConfig:
    """The episode budgets and chat settings of ``cfg.rollout`` as the agent loop's typed
    :class:`~trainer.rollout.agent_loop.AgentLoopConfig` (``max_total_tokens``, ``max_turns``,
    ``max_observation_tokens``, ``use_chat_template``, ``system_prompt``, ``observation_role``,
    ``stop``)."""
    r = cfg.rollout
    return AgentLoopConfig(max_total_tokens=r.max_total_tokens, max_turns=r.max_turns,
                           max_observation_tokens=r.max_observation_tokens,
                           use_chat_template=r.use_chat_template, system_prompt=r.system_prompt,
                           observation_role=r.observation_role, stop=tuple(r.stop))
