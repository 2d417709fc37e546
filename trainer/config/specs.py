"""Typed specs built from the experiment config where a run is assembled: an engine's
(:func:`engine_spec`), the agent loop's (:func:`agent_loop_config`), a learner backend's
(:func:`learner_spec`, with :func:`learner_config` / :func:`optimizer_settings`), a task's
(:func:`task_spec`, defined in :mod:`trainer.config.task_spec`) and the warm-start cache's key
(:func:`warm_start_cache_spec`).

A component below the config layer (an engine, a learner backend) never reads the experiment
config: its factory gets a typed spec holding what it needs, built here, once, from the config's
sections and the component's own registered settings (:func:`trainer.config.plugin_settings`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..engines.base import SamplingParams
from ..engines.registry import ENGINES, EngineCheck, EngineSpec, Weights
from ..errors import ConfigError
from ..learner.settings import LearnerConfig, OptimizerSettings, step_fields
from ..learner.spec import LearnerSpec
from ..plugins import absolute_plugins
from ..rollout.agent_loop import AgentLoopConfig
from . import plugin_metadata, plugin_settings
from .sections import ModelConfig, RolloutConfig, TaskConfig, WarmStartConfig
from .task_spec import TaskSpec, task_spec  # noqa: F401 - re-exported: a task's spec and builder
from .train_section import FixedStaleness

if TYPE_CHECKING:  # typing only: the config package imports this module
    from . import ExperimentConfig


def engine_spec(cfg: ExperimentConfig, model_dir: Path | str, tokenizer: Any, *, version: int = 0,
                weights: Weights | None = None, work_dir: Path | None = None,
                adapter: Any = None) -> EngineSpec:
    """The :class:`~trainer.engines.registry.EngineSpec` of ``cfg.rollout.engine``.

    Args:
        cfg: the validated experiment config (``model.dtype``, ``model.attn_implementation``,
            ``rollout.engine_max_batch_size``, ``train.staleness`` and the engine's
            ``rollout.engine_settings`` are read).
        model_dir, tokenizer, version, weights, work_dir, adapter: as the spec's fields.

    Raises:
        ConfigError: bad ``rollout.engine_settings`` (one line naming the key).
    """
    return EngineSpec(model_dir=Path(model_dir), tokenizer=tokenizer, version=version, weights=weights,
                      work_dir=work_dir, adapter=adapter, settings=plugin_settings(cfg, "rollout.engine"),
                      dtype=cfg.model.dtype, attn_implementation=cfg.model.attn_implementation,
                      max_batch_size=cfg.rollout.engine_max_batch_size, fixed_lag=fixed_lag(cfg))


def fixed_lag(cfg: ExperimentConfig) -> int | None:
    """The fixed lag k of ``train.staleness`` (the effective one,
    :attr:`~trainer.config.ExperimentConfig.staleness`), None under bounded staleness."""
    return cfg.staleness.lag if isinstance(cfg.staleness, FixedStaleness) else None


def preflight_engine(cfg: ExperimentConfig, *, evaluation: bool = False) -> None:
    """Run the preflight check ``cfg.rollout.engine`` was registered with (no-op without one) on the
    run's :class:`~trainer.engines.registry.EngineCheck`: the engine's settings, the rollouts'
    sampling (``rollout.temperature`` / ``top_p`` / ``top_k`` / ``max_new_tokens``), whether the
    policy is a LoRA adapter (``learner.lora``), the fixed lag of ``train.staleness`` (the
    effective one, :attr:`~trainer.config.ExperimentConfig.staleness`) and the launcher (its name,
    whether it runs rollouts in worker processes).

    With ``evaluation`` (``copc eval``: no weight sync, and its own sampling, top_p 1, greedy or at
    ``eval.temperature``) the check gets the engine's settings only: default sampling, no LoRA, no
    fixed lag (a run's ``rollout.top_p`` or ``keep_adapters`` does not concern its evaluation).

    Raises:
        ConfigError: unknown engine (naming ``rollout.engine`` and the registered ones), or from
            the check (e.g. SGLang without a GPU, ``vllm`` with ``rollout.top_p < 1``).
    """
    try:
        check = ENGINES.metadata(cfg.rollout.engine)["preflight"]
    except KeyError as e:  # RegistryError: one line naming rollout.engine
        raise ConfigError(str(e)) from None
    if check is None:
        return
    if evaluation:
        check(EngineCheck(settings=plugin_settings(cfg, "rollout.engine")))
        return
    r = cfg.rollout
    check(EngineCheck(settings=plugin_settings(cfg, "rollout.engine"),
                      sampling=SamplingParams(temperature=r.temperature, top_p=r.top_p, top_k=r.top_k,
                                              max_new_tokens=r.max_new_tokens),
                      lora=cfg.learner.lora_settings()[0] is not None,
                      fixed_lag=fixed_lag(cfg), launcher=cfg.launcher.kind,
                      rollout_workers=bool(plugin_metadata(cfg, "launcher.kind").get("rollout_workers"))))


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


@dataclass(frozen=True)
class HeldOutSpec:
    """What ``copc train``'s held-out evaluation (:func:`trainer.evaluate.heldout.evaluate_held_out`)
    needs, read from the experiment config by :func:`held_out_spec`.

    Attributes:
        k: episodes per held-out question (``eval.k``).
        temperature: sampling temperature, 0 = greedy (``eval.temperature``).
        seed: base sampling seed (``train.seed``).
        max_new_tokens: tokens per model turn (``rollout.max_new_tokens``).
        agent: the episode budgets (:func:`agent_loop_config`).
        output_dir: the run's folder; records go to ``<output_dir>/eval/<name>.jsonl``.
        progress: draw a progress bar while it runs (``logging.progress``).
    """

    k: int
    temperature: float
    seed: int
    max_new_tokens: int
    agent: AgentLoopConfig
    output_dir: Path
    progress: bool


def held_out_spec(cfg: ExperimentConfig) -> HeldOutSpec:
    """The :class:`HeldOutSpec` of ``cfg`` (``eval.k`` / ``temperature``, ``train.seed``,
    ``rollout.max_new_tokens`` and budgets, ``output_dir``, ``logging.progress``)."""
    return HeldOutSpec(k=cfg.eval.k, temperature=cfg.eval.temperature, seed=cfg.train.seed,
                       max_new_tokens=cfg.rollout.max_new_tokens, agent=agent_loop_config(cfg),
                       output_dir=Path(cfg.output_dir), progress=bool(cfg.logging.progress))


@dataclass(frozen=True)
class WarmStartCacheSpec:
    """What a supervised warm-start result depends on: the settings hashed into its key in the
    shared warm-start cache (:func:`trainer.warmstart.cache.cache_key`), read from the experiment
    config by :func:`warm_start_cache_spec`.

    Attributes:
        model: the ``model`` section. task: the ``task`` section.
        rollout: the ``rollout`` section (the cache leaves its RL-generation keys out of the key).
        warm_start: the ``warm_start`` section (the cache leaves ``cache_dir`` out of the key).
        seed: ``train.seed``. torch_threads: ``train.torch_threads``.
        autocast_dtype: the learner backend's ``autocast_dtype`` (the SFT computes in it), or None.
    """

    model: ModelConfig
    task: TaskConfig
    rollout: RolloutConfig
    warm_start: WarmStartConfig
    seed: int
    torch_threads: int
    autocast_dtype: str | None = None


def warm_start_cache_spec(cfg: ExperimentConfig) -> WarmStartCacheSpec:
    """The :class:`WarmStartCacheSpec` of ``cfg`` (its ``model``, ``task``, ``rollout`` and
    ``warm_start`` sections, ``train.seed``, ``train.torch_threads`` and the learner backend's
    ``autocast_dtype``)."""
    return WarmStartCacheSpec(model=cfg.model, task=cfg.task, rollout=cfg.rollout, warm_start=cfg.warm_start,
                              seed=cfg.train.seed, torch_threads=cfg.train.torch_threads,
                              autocast_dtype=getattr(plugin_settings(cfg, "learner.backend"),
                                                     "autocast_dtype", None))


def optimizer_settings(cfg: ExperimentConfig) -> OptimizerSettings:
    """The :class:`~trainer.learner.settings.OptimizerSettings` of ``cfg`` (``learner.optimizer``,
    ``train.actor_lr`` / ``critic_lr`` / ``weight_decay`` / ``grad_clip`` / ``warmup_steps``)."""
    t = cfg.train
    return OptimizerSettings(name=cfg.learner.optimizer, actor_lr=t.actor_lr, critic_lr=t.critic_lr,
                             weight_decay=t.weight_decay, grad_clip=t.grad_clip, warmup_steps=t.warmup_steps)


def learner_config(cfg: ExperimentConfig, backend: Any = None) -> LearnerConfig:
    """The step settings (:class:`~trainer.learner.settings.LearnerConfig`) of ``cfg``: ``train``,
    ``learner.optimizer``, ``learner.lora`` / ``learner.critic_lora`` and ``rollout.temperature`` /
    ``top_k`` / ``top_p`` (the learner's log-probs replay the sampler's support), with the step
    fields of the backend's own settings.

    Args:
        cfg: the validated experiment config.
        backend: the backend's settings (``learner.backend_settings`` as its dataclass, e.g.
            :class:`~trainer.learner.backend_settings.TorchSettings`); None: those of
            ``learner.backend`` (:func:`trainer.config.plugin_settings`). Its fields named in
            :data:`~trainer.learner.settings.STEP_FIELDS` are carried over; the others keep their
            defaults.

    Raises:
        ConfigError: as :func:`trainer.config.plugin_settings` (bad backend settings).
    """
    own = plugin_settings(cfg, "learner.backend") if backend is None else backend
    t = cfg.train
    lora, critic_lora = cfg.learner.lora_settings()
    return LearnerConfig(optim=optimizer_settings(cfg), critic_warmup_steps=t.critic_warmup_steps,
                         num_mini_batches=t.num_mini_batches, micro_batch_size=t.micro_batch_size,
                         temperature=cfg.rollout.temperature, top_k=cfg.rollout.top_k,
                         top_p=cfg.rollout.top_p, seed=t.seed, lora=lora, critic_lora=critic_lora,
                         critic_updates_per_step=t.critic_updates_per_step,
                         value_probes=t.value_probe_settings, **step_fields(own))


def learner_spec(cfg: ExperimentConfig) -> LearnerSpec:
    """The :class:`~trainer.learner.spec.LearnerSpec` of ``cfg.learner.backend``: what a learner
    backend's factory gets instead of the config (``learner``, ``train``, ``model``, ``rollout``,
    ``logging.samples_per_step``, ``plugins`` and the algorithm are read here, once).

    Raises:
        ConfigError: an unregistered ``learner.backend`` or bad ``learner.backend_settings`` (one
            line naming the key); a bad algorithm (:meth:`~trainer.config.ExperimentConfig.algorithm_config`).
    """
    own = plugin_settings(cfg, "learner.backend")
    return LearnerSpec(backend=cfg.learner.backend, algorithm=cfg.algorithm_config(),
                       step=learner_config(cfg, own), settings=own,
                       raw_settings=dict(cfg.learner.backend_settings or {}), dtype=cfg.model.dtype,
                       attn_implementation=cfg.model.attn_implementation,
                       plugins=tuple(absolute_plugins(cfg.plugins)), torch_threads=cfg.train.torch_threads,
                       malloc_mmap_threshold=cfg.learner.malloc_mmap_threshold,
                       malloc_trim=bool(cfg.learner.malloc_trim),
                       keep_step_inputs=bool(cfg.logging.samples_per_step))
