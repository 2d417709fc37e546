"""The main job: ``copc train`` — warm-start, evaluate, asynchronous RL, evaluate, report.

``run_experiment(cfg, resume)`` builds a :class:`~trainer.app.context.RunContext` (task, optional
supervised warm-start, learner of ``learner.backend``, checkpoints, resume state), starts the
engine of ``rollout.engine`` through the engine registry, then runs a held-out evaluation,
asynchronous RL with the configured preset (checkpointed, resumable), a second evaluation,
and writes per-question records (``eval/before_rl.jsonl``, ``eval/after_rl.jsonl``), plots,
``summary.json`` (with the paired ``eval_delta``) and a printed before/after table. Every
phase talks to the learner through the :class:`~trainer.learner.base.Learner` protocol and to
the engine through an :class:`~trainer.engines.registry.EngineHandle`; nothing here branches on
a backend name.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
from pathlib import Path
from typing import Any

import numpy as np

from ..config import ConfigError, ExperimentConfig, plugin_settings
from ..config.specs import engine_spec, held_out_spec, learner_spec, preflight_engine, task_spec
from ..engines import EngineHandle, make_engine
from ..engines.base import SamplingParams
from ..evaluate.heldout import AFTER_RL, BEFORE_RL, eval_delta, evaluate_held_out
from ..evaluate.policy import checkpoint_policy_weights
from ..learner import DistributedSettings, learner_checkpoint_state
from ..models.lora import adapter_of
from ..orchestration.launchers import launch
from ..orchestration.loop import AsyncTrainingLoop
from ..orchestration.rollouts import LoopHooks
from ..orchestration.samples import step_samples
from ..orchestration.state import LoopState
from ..outputs.checkpoint import CheckpointManager, rng_state
from ..outputs.lock import lock_output_dir
from ..outputs.metrics_log import last_steps_mean, write_summary
from ..outputs.progress import TrainProgress
from ..outputs.report import print_report
from ..outputs.viewer.samples import write_step_samples
from .assemble import launch_spec, loop_config
from .context import RunContext, build_context, initial_model_dir
from .memory_check import check_memory

log = logging.getLogger(__name__)


def rollout_sampling(cfg: ExperimentConfig) -> SamplingParams:
    """Training rollouts' sampling parameters (``rollout`` section; seeded by ``train.seed``)."""
    r = cfg.rollout
    return SamplingParams(temperature=r.temperature, top_p=r.top_p, top_k=r.top_k,
                          max_new_tokens=r.max_new_tokens, seed=cfg.train.seed)


async def open_engine(cfg: ExperimentConfig, model_dir: Path, tokenizer: Any, out: Path, version: int = 0,
                      weights: Any = None, adapter: Any = None) -> EngineHandle:
    """Start the engine of ``rollout.engine`` (through the registry; may take a while for a server).

    Args:
        weights: initial weights overriding ``model_dir``'s (``Learner.export_policy_weights()``
            of a resumed learner), or None.
        adapter: a LoRA learner's adapter (``Learner.export_adapter()``): the engine serves
            ``model_dir``'s weights with it, and syncs send adapters only.
    """
    spec = engine_spec(cfg, model_dir, tokenizer, version=version, weights=weights, work_dir=out,
                       adapter=adapter)
    return await asyncio.to_thread(make_engine, cfg.rollout.engine, spec)


async def _evaluate_alone(cfg: ExperimentConfig, engine: Any, task: Any, tok: Any, name: str) -> dict:
    """:func:`_evaluate` while nothing else computes (before and after RL): an engine with
    ``set_intra_op_threads`` (the embedded one) runs it on every core, then goes back to
    ``train.torch_threads`` (on 2 cores, 60 held-out questions of the search main job took 180 s on
    one thread and 104 s on two; one measurement each)."""
    set_threads = getattr(engine, "set_intra_op_threads", None)
    if set_threads is None or not cfg.train.torch_threads:
        return await _evaluate(cfg, engine, task, tok, name)
    set_threads(max(cfg.train.torch_threads, os.cpu_count() or 1))
    try:
        return await _evaluate(cfg, engine, task, tok, name)
    finally:
        set_threads(cfg.train.torch_threads)


async def _evaluate(cfg: ExperimentConfig, engine: Any, task: Any, tok: Any, name: str) -> dict:
    """Held-out evaluation (:func:`trainer.evaluate.heldout.evaluate_held_out`, the evaluation
    core on ``task.eval_samples``); its records go to ``<output_dir>/eval/<name>.jsonl``."""
    return await evaluate_held_out(held_out_spec(cfg), engine, task, tok, name)


def run_experiment(cfg: ExperimentConfig, resume: bool = False) -> dict:
    """Run (or resume) the experiment described by ``cfg``; return the summary dict.

    Resume: see :func:`trainer.app.context.build_context` (models, optimizers, schedulers, RNG
    states, prompt cursor, counters and step restored; metrics after the checkpoint re-done).

    Under ``torchrun`` with ``learner.backend_settings.launch=torchrun`` a process with ``RANK > 0`` only
    serves as a
    learner rank (:func:`~trainer.learner.distributed.worker.serve_torchrun_worker`) and returns ``{}``.

    Raises:
        ConfigError: a setting only checkable at start-up (the message names the key).
        TrainingError: the run stopped on a failure (the last good state is checkpointed).
    """
    own = plugin_settings(cfg, "learner.backend")  # the backend's settings: its launch, if distributed
    torchrun_rank = isinstance(own, DistributedSettings) and own.launch == "torchrun"
    if torchrun_rank and int(os.environ.get("RANK", "0")) > 0:
        from ..learner.distributed.worker import serve_torchrun_worker

        serve_torchrun_worker(learner_spec(cfg))  # a learner rank serving rank 0 (the driver) until done
        return {}
    preflight_engine(cfg)  # ConfigError naming rollout.engine
    memory = check_memory(cfg)  # ConfigError naming the setting to change, before any model is loaded
    out = Path(cfg.output_dir)
    if resume and (out / "summary.json").exists():
        done = CheckpointManager(out / "checkpoints").latest()
        if done is not None and CheckpointManager.step_of(done) >= cfg.train.total_steps:
            summary = json.loads((out / "summary.json").read_text())
            log.warning("--resume: the run in %s already finished %d steps; nothing to do",
                        out, cfg.train.total_steps)
            print_report(summary)
            return summary
    ctx = build_context(cfg, resume)
    memory.report()  # the estimate's line, once the run directory is this run's
    try:
        asyncio.run(_eval_rl_eval(ctx))
        summary = ctx.summary
        summary["wall_s"] = ctx.wall_s()
        records = ctx.logger.read()  # metrics.jsonl, read once for the tail means and the plots
        summary["train_tail"] = last_steps_mean(records)  # the last 20 % of RL steps
        if cfg.logging.plots:
            from ..outputs.plots import make_plots
            summary["plots"] = [str(p) for p in make_plots(records, ctx.out)]
        write_summary(ctx.out, summary)
        print_report(summary)
        return summary
    finally:
        ctx.close()


async def _eval_rl_eval(ctx: RunContext) -> None:
    """Evaluation before RL, the RL phase, evaluation after, on one event loop and one engine."""
    cfg, learner = ctx.cfg, ctx.learner
    resumed = ctx.resume_state is not None
    adapter = adapter_of(learner)  # a LoRA learner: the engine gets its adapter, never full weights
    weights = learner.export_policy_weights() if resumed and adapter is None else None
    handle = await open_engine(cfg, ctx.model_dir, ctx.tokenizer, ctx.out, version=learner.policy_version,
                               weights=weights, adapter=adapter)
    try:
        if cfg.eval.enabled and "eval_before" not in ctx.summary:
            ctx.summary["eval_before"] = await _evaluate_alone(cfg, handle.engine, ctx.task, ctx.tokenizer,
                                                               BEFORE_RL)
            ctx.logger.log(ctx.start_step, {f"eval/{k}": v for k, v in ctx.summary["eval_before"].items()
                                            if isinstance(v, int | float)})
        ctx.summary.update(await _rl(ctx, handle))
        if cfg.eval.enabled:
            ctx.summary["eval_after"] = await _evaluate_alone(cfg, handle.engine, ctx.task, ctx.tokenizer,
                                                              AFTER_RL)
            delta = eval_delta(ctx.out / "eval")  # paired after − before, per question
            if delta is not None:
                ctx.summary["eval_delta"] = delta
            # one metrics line per step: the after-RL evaluation is its own row after the last step
            after = ctx.summary["eval_after"]
            ctx.logger.log(cfg.train.total_steps + 1,
                           {f"eval/{k}": v for k, v in after.items() if isinstance(v, int | float)})
    finally:
        await handle.close()


def run_devices(cfg: ExperimentConfig) -> int:
    """The devices a run trains on, for ``perf/tokens_per_s_per_device`` (the paper's Table 3):
    the learner's ranks (a distributed backend's ``world_size``, else 1) plus the engine's own GPUs
    when its settings have a tensor-parallel size (SGLang: ``tp × dp``); an engine without one (the
    embedded engine) shares the learner's device."""
    eng = plugin_settings(cfg, "rollout.engine")
    own = int(getattr(eng, "tp", 0) or 0) * int(getattr(eng, "dp", 1) or 1)
    learner = plugin_settings(cfg, "learner.backend")
    ranks = learner.world_size if isinstance(learner, DistributedSettings) else 1
    return max(1, ranks + own)


class RunHooks(LoopHooks):
    """``copc train``'s :class:`~trainer.orchestration.rollouts.LoopHooks`: metrics (with the
    staleness histogram) to the run's logger and progress bar, checkpoints of the trained learner.

    Args:
        ctx: the run's :class:`~trainer.app.context.RunContext`.
        learner: the learner being trained (the launcher's: the driver's, or a Ray-hosted one).
        progress: the live progress bar.
    """

    def __init__(self, ctx: RunContext, learner: Any, progress: TrainProgress, engine: Any = None) -> None:
        self.ctx, self.learner, self.progress, self.engine = ctx, learner, progress, engine
        self.t0 = time.time()
        self.devices = run_devices(ctx.cfg)

    async def evaluate(self, step: int) -> dict[str, float]:
        """The held-out evaluation on the engine's current policy (``eval.every_steps``), records
        in ``eval/step_<step>.jsonl``; ``eval/policy_version`` is the engine's version when it
        started, ``eval/mixed_versions`` 1 when the engine was synced during it (fixed lag)."""
        if self.engine is None:  # the Ray launcher: the training engines are the workers'
            log.warning("eval.every_steps: not run: the rollouts do not generate with this process's "
                        "engine (local launcher only)")
            return {}
        version = self.engine.version
        ctx = self.ctx
        summary = await _evaluate(ctx.cfg, self.engine, ctx.task, ctx.tokenizer, f"step_{step}")
        out = {f"eval/{k}": float(v) for k, v in summary.items() if isinstance(v, int | float)}
        out.update({"eval/policy_version": float(version),
                    "eval/mixed_versions": float(self.engine.version != version)})
        return out

    def on_step(self, step: int, metrics: dict, uids: list[int]) -> None:
        """Log the step's scalars; ``staleness/token_mean`` and ``staleness/hist`` (counts per
        staleness level, index = policy versions behind) from ``staleness/per_token``;
        ``perf/tokens_per_s_per_device`` (:func:`run_devices`)."""
        self.ctx.trained_uids.extend(uids)
        scalars = {k: v for k, v in metrics.items() if isinstance(v, int | float)}
        if "perf/tokens_per_s" in scalars:
            scalars["perf/tokens_per_s_per_device"] = scalars["perf/tokens_per_s"] / self.devices
        per_token = metrics.get("staleness/per_token")  # staleness of every trained model token
        if per_token:
            scalars["staleness/token_mean"] = float(np.mean(per_token))
            scalars["staleness/hist"] = np.bincount(np.asarray(per_token, dtype=np.int64)).tolist()
        self.ctx.logger.log(step, scalars)
        self.progress.update(step, scalars, time.time() - self.t0)

    def on_trained(self, step: int, trajs: list, learner: Any) -> None:
        """Write ``logging.samples_per_step`` of the step's episodes with their per-token tensors to
        ``samples/step_N.jsonl`` (:func:`~trainer.orchestration.samples.step_samples`), capped at
        ``logging.samples_max_bytes``."""
        log_cfg = self.ctx.cfg.logging
        if log_cfg.samples_per_step:
            recs = step_samples(step, trajs, learner, self.ctx.tokenizer, log_cfg.samples_per_step)
            write_step_samples(self.ctx.cfg.output_dir, step, recs, log_cfg.samples_max_bytes)

    def save_checkpoint(self, step: int, loop_state: dict) -> bool:
        """Write checkpoint ``step``: learner, loop state, RNG states, trained draws, summary."""
        ctx = self.ctx
        ctx.checkpoints.save(step, {**learner_checkpoint_state(self.learner), "loop": loop_state,
                                    "rng": rng_state(), "trained_uids": list(ctx.trained_uids),
                                    "summary": ctx.resumable_summary()})
        return True


async def _rl(ctx: RunContext, handle: EngineHandle) -> dict:
    """The asynchronous RL phase on the launcher of ``launcher.kind``; returns RL summary fields
    (counters cumulative over resumes)."""
    cfg = ctx.cfg
    progress = TrainProgress(cfg.train.total_steps, ctx.start_step, enabled=cfg.logging.progress)
    saved = (ctx.resume_state or {}).get("loop")  # step, counters, fixed lag's kept versions
    state = LoopState.resume(saved) if saved else LoopState(step=ctx.start_step, counters=ctx.counters)
    loop_cfg = loop_config(cfg, pad_token_id=ctx.tokenizer.pad_token_id)
    spec = launch_spec(cfg, learner=ctx.learner, engine=handle, task=ctx.task, tokenizer=ctx.tokenizer,
                       model_dir=ctx.model_dir, sampling=rollout_sampling(cfg))
    t0 = time.time()
    async with launch(spec) as (learner, rollouts):
        # evaluations during RL use the engine the rollouts train with (the local launcher's)
        same = getattr(rollouts, "engine", None) is handle.engine
        hooks = RunHooks(ctx, learner, progress, handle.engine if same else None)
        loop = AsyncTrainingLoop(learner, rollouts, ctx.prompts, loop_cfg, hooks, state)
        with progress:
            await loop.run()
    return {"rl_wall_s": time.time() - t0, "steps": state.step, **state.counters,  # cumulative (COUNTERS)
            "trained_uids": len(ctx.trained_uids),
            "duplicate_trained_uids": len(ctx.trained_uids) - len(set(ctx.trained_uids))}


def run_evaluation(cfg: ExperimentConfig, checkpoint: str | None = None) -> dict:
    """Standalone evaluation (``copc eval``).

    ``checkpoint``: a model directory (``save_pretrained``) or a training checkpoint directory;
    None: the run's latest checkpoint, else its initial model (``model.path`` / tiny / warm-start).

    Raises:
        ConfigError: no model to evaluate, a bad ``--checkpoint``, or another copc process
            writing into ``output_dir``.
    """
    preflight_engine(cfg, evaluation=True)  # ConfigError naming rollout.engine
    out = Path(cfg.output_dir)
    latest = CheckpointManager(out / "checkpoints").latest() if (out / "checkpoints").is_dir() else None
    ws, init = out / "warm_start_model", out / "init_model"
    if checkpoint:
        path = Path(checkpoint)
        if not path.is_dir():
            raise ConfigError(f"--checkpoint={checkpoint!r}: no such directory")
    elif latest is not None:
        path = latest
    elif (ws / "config.json").exists():
        path = ws
    elif cfg.model.path or (init / "config.json").exists():
        path = Path(cfg.model.path) if cfg.model.path else init
    else:
        raise ConfigError(f"output_dir={cfg.output_dir!r}: no checkpoint, warm-start or initial model "
                          "there (train first, or pass --checkpoint / model.path)")
    lock = lock_output_dir(out)  # copc eval --config writes <output_dir>/eval/: one writer at a time
    try:
        return _evaluate_path(cfg, path, out, ws)
    finally:
        lock.close()


def _evaluate_path(cfg: ExperimentConfig, path: Path, out: Path, ws: Path) -> dict:
    """:func:`run_evaluation` of the model or checkpoint ``path`` (the run directory locked)."""
    from ..models.loading import load_tokenizer
    from ..tasks import build_task

    print(f"copc eval: evaluating {path}")
    weights, model_dir = None, path
    if not (path / "config.json").exists():  # a training checkpoint directory
        model_dir = ws if (ws / "config.json").exists() else initial_model_dir(cfg, out)
        weights = checkpoint_policy_weights(learner_spec(cfg), path, model_dir)
    task = build_task(task_spec(cfg))
    tok = load_tokenizer(model_dir)
    from ..rollout.observation import check_chat_template

    check_chat_template(tok, cfg.rollout.use_chat_template, model_dir)
    try:
        res = asyncio.run(_standalone_eval(cfg, model_dir, tok, weights, task, out))
        print(json.dumps(res, indent=2))
        return res
    finally:
        task.close()


async def _standalone_eval(cfg: ExperimentConfig, model_dir: Path, tok: Any, weights: Any, task: Any,
                           out: Path) -> dict:
    handle = await open_engine(cfg, model_dir, tok, out, weights=None if weights is None else weights.items())
    try:
        return await _evaluate(cfg, handle.engine, task, tok, "standalone")
    finally:
        await handle.close()
