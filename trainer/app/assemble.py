"""The orchestration's typed inputs, built from the experiment config where the run is assembled:
the loop's settings (:func:`loop_config`) and what a launcher gets (:func:`launch_spec`).

The orchestration layer never reads the experiment config (``tests/test_config_reads.py``): its
:class:`~trainer.orchestration.loop.LoopConfig` and
:class:`~trainer.orchestration.launchers.LaunchSpec` are filled here, once, from the config's
sections and the launcher's own registered settings (:func:`trainer.config.plugin_settings`).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..config import plugin_settings
from ..config.specs import agent_loop_config, engine_spec, learner_spec
from ..orchestration.attestation import SyncCheck
from ..orchestration.group_filter import GroupFilter
from ..orchestration.launchers import LaunchSpec
from ..orchestration.loop import LoopConfig
from ..orchestration.staleness import staleness_strategy
from ..orchestration.truncation import TruncationSettings
from ..plugins import absolute_plugins

if TYPE_CHECKING:
    from ..config import ExperimentConfig
    from ..engines.base import SamplingParams
    from ..engines.registry import EngineHandle


def loop_config(cfg: ExperimentConfig, *, pad_token_id: int) -> LoopConfig:
    """The :class:`~trainer.orchestration.loop.LoopConfig` of ``cfg``.

    Args:
        cfg: the validated experiment config: ``train.total_steps`` / ``prompts_per_step`` /
            ``sync_check_tolerance`` / ``max_infra_failure_fraction`` / ``filter_groups`` /
            ``max_filtered_groups_per_batch``, ``rollout.n_samples_per_prompt`` / ``temperature``,
            ``model.dtype``, ``eval.enabled`` / ``every_steps``, ``checkpoint.every_steps``,
            ``learner.malloc_trim``, ``rollout.max_new_tokens`` / ``max_total_tokens`` (the
            truncation warning) and the effective staleness (``cfg.staleness``, a preset's own
            included).
        pad_token_id: the tokenizer's pad id.
    """
    tol = cfg.train.sync_check_tolerance
    check = None if tol is None else SyncCheck(tol, cfg.rollout.temperature, cfg.model.dtype)
    t = cfg.train
    return LoopConfig(sync_check=check, eval_every=cfg.eval.every_steps if cfg.eval.enabled else 0,
                      total_steps=t.total_steps, prompts_per_step=t.prompts_per_step,
                      n_samples_per_prompt=cfg.rollout.n_samples_per_prompt, pad_token_id=pad_token_id,
                      staleness=staleness_strategy(cfg.staleness),
                      checkpoint_every=cfg.checkpoint.every_steps,
                      max_infra_failure_fraction=t.max_infra_failure_fraction,
                      malloc_trim=cfg.learner.malloc_trim,
                      group_filter=GroupFilter(t.max_filtered_groups_per_batch) if t.filter_groups else None,
                      truncation=TruncationSettings(cfg.rollout.max_new_tokens, cfg.rollout.max_total_tokens))


def launch_spec(cfg: ExperimentConfig, *, learner: Any, engine: EngineHandle, task: Any, tokenizer: Any,
                model_dir: Path, sampling: SamplingParams) -> LaunchSpec:
    """The :class:`~trainer.orchestration.launchers.LaunchSpec` of ``cfg.launcher.kind``.

    Args:
        cfg: the validated experiment config (``launcher``, ``rollout.concurrency`` /
            ``rollout.engine`` and the engine's spec, its work directory ``output_dir`` (a Ray
            worker's engine writes under ``<output_dir>/rollout_worker_<i>``), the learner's spec,
            ``plugins``).
        learner: the driver's (restored) learner. engine: its started engine.
        task: the started task. tokenizer: the policy tokenizer.
        model_dir: the policy's ``save_pretrained`` directory. sampling: rollout sampling.

    Raises:
        ConfigError: an unregistered launcher or bad ``launcher.settings`` (one line naming the key).
    """
    return LaunchSpec(kind=cfg.launcher.kind, settings=plugin_settings(cfg, "launcher.kind"),
                      learner=learner, engine=engine, task=task, tokenizer=tokenizer,
                      model_dir=Path(model_dir), sampling=sampling, agent_cfg=agent_loop_config(cfg),
                      concurrency=cfg.rollout.concurrency, engine_kind=cfg.rollout.engine,
                      engine_spec=engine_spec(cfg, model_dir, None, work_dir=Path(cfg.output_dir).absolute()),
                      learner_spec=learner_spec(cfg),
                      plugins=tuple(absolute_plugins(cfg.plugins)))
