"""The composition root of a run: :class:`RunContext` holds what every phase of ``copc train`` needs.

:func:`build_context` turns a validated :class:`~trainer.config.ExperimentConfig` into a
context: output directory, checkpoints (and the resume state), the task (data, services,
environment factory), the policy's model directory and tokenizer (after the optional
warm-start), the learner (``learner.backend``), the prompt stream and the cumulative
counters. The phases in :mod:`trainer.app.run` take the context instead of a dozen parameters;
each seam is chosen by name from the config: ``task.env`` → :mod:`trainer.tasks`,
``learner.backend`` → :mod:`trainer.learner`, ``rollout.engine`` → :mod:`trainer.engines`.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import random
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from environments.errors import InfrastructureError

from ..config import ExperimentConfig, plugin_settings
from ..config.specs import agent_loop_config, learner_spec, task_spec, warm_start_cache_spec
from ..errors import ConfigError, TrainingError
from ..learner import Learner, make_learner, restore_learner
from ..learner.allocator import set_malloc_mmap_threshold
from ..models.loading import load_model_and_tokenizer, load_tokenizer
from ..models.tiny import TinyModelConfig, save_tiny_checkpoint
from ..orchestration.prompts import PromptStream
from ..outputs.checkpoint import CheckpointError, CheckpointManager, set_rng_state
from ..outputs.lock import lock_output_dir
from ..outputs.metrics_log import MetricsLogger
from ..rollout.agent_loop import AgentLoopConfig
from ..rollout.observation import check_chat_template
from ..warmstart.cache import cache_key, restore, store
from .memory_check import check_sft_memory

log = logging.getLogger(__name__)


def seed_everything(seed: int) -> None:
    """Seed python, numpy and torch."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def initial_model_dir(cfg: ExperimentConfig, out: Path, task: Any = None) -> Path:
    """``model.path``, or a tiny model built once into ``<output_dir>/init_model``.

    With ``model.tiny.tokenizer: bpe`` its tokenizer is a byte-level BPE of
    ``model.tiny.vocab_size`` tokens trained on ``task.tokenizer_texts()`` with
    ``task.tokenizer_tags`` as single tokens (:func:`trainer.models.bpe.train_bpe_tokenizer`);
    the directory is written atomically (a crash never leaves half a model to reuse).
    """
    if cfg.model.path:
        return Path(cfg.model.path)
    d = out / "init_model"
    if (d / "config.json").exists():
        return d
    spec = vars(cfg.model.tiny).copy()
    kind, vocab = spec.pop("tokenizer"), spec.pop("vocab_size")
    tok = None
    if kind == "bpe":
        from ..models.bpe import train_bpe_tokenizer

        if task is None:
            raise TrainingError("model.tiny.tokenizer='bpe' needs the task's text to train on")
        t0 = time.time()
        tok = train_bpe_tokenizer(task.tokenizer_texts(), vocab, task.tokenizer_tags)
        log.info("tokenizer: byte-level BPE of %d tokens trained in %.1f s", len(tok), time.time() - t0)
    tmp = out / ".init_model.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    save_tiny_checkpoint(tmp, TinyModelConfig(**spec), tok)
    shutil.rmtree(d, ignore_errors=True)
    tmp.rename(d)
    return d


@dataclass
class RunContext:
    """Everything the phases of a run share.

    Attributes:
        cfg: the validated config.
        out: ``output_dir``.
        task: the :class:`~trainer.tasks.Task` (started services; closed by :meth:`close`).
        model_dir: ``save_pretrained`` directory of the policy the learner starts from (the
            warm-start result when there is one): architecture + tokenizer for every engine.
        tokenizer: the policy tokenizer.
        learner: the :class:`~trainer.learner.base.Learner` (resumed state loaded).
        logger: metrics logger (``metrics.jsonl``, TensorBoard).
        checkpoints: the run's :class:`CheckpointManager`.
        resume_state: the loaded checkpoint, or None for a fresh run.
        prompts: the training :class:`PromptStream` (cursor restored on resume).
        start_step: steps already done.
        trained_uids: prompt draws trained so far (resume included).
        counters: cumulative loop counters restored from the checkpoint.
        summary: the run summary being built (``summary.json``).
        t_start: wall-clock start of this invocation (seconds since the epoch).
    """

    cfg: ExperimentConfig
    out: Path
    task: Any
    model_dir: Path
    tokenizer: Any
    learner: Learner
    logger: MetricsLogger
    checkpoints: CheckpointManager
    resume_state: dict | None
    prompts: PromptStream
    start_step: int = 0
    trained_uids: list[int] = field(default_factory=list)
    counters: dict[str, int] = field(default_factory=dict)
    summary: dict[str, Any] = field(default_factory=dict)
    t_start: float = field(default_factory=time.time)
    #: the open lock file of ``out`` (:func:`trainer.outputs.lock.lock_output_dir`), held by the run
    lock: Any = None

    def agent_config(self) -> AgentLoopConfig:
        """Episode budgets of the config (:func:`trainer.config.specs.agent_loop_config`)."""
        return agent_loop_config(self.cfg)

    def wall_s(self) -> float:
        """Seconds spent on this run so far, earlier invocations (before a resume) included."""
        return float(self.summary.get("wall_s_before_resume", 0.0)) + time.time() - self.t_start

    def resumable_summary(self) -> dict:
        """What a checkpoint keeps of the summary: evaluation before RL, warm-start metrics and
        the wall time so far (as ``wall_s_before_resume``)."""
        kept = {k: v for k, v in self.summary.items() if k in ("eval_before", "warm_start")}
        kept["wall_s_before_resume"] = self.wall_s()
        return kept

    def close(self) -> None:
        """Close the logger, the task's services and the learner (a distributed learner's ranks),
        then release the run directory's lock."""
        try:
            self.logger.close()
        finally:
            try:
                self.task.close()
            finally:
                try:
                    close_learner(self.learner)
                finally:
                    if self.lock is not None:
                        self.lock.close()


def close_learner(learner: Any) -> None:
    """Stop a learner's processes when it has any (``close()``: distributed backends)."""
    close = getattr(learner, "close", None)
    if callable(close):
        close()


def saved_counters(loop_state: dict) -> dict[str, int]:
    """Cumulative counters of a checkpoint's loop state (older checkpoints: ``dropped_stale`` only)."""
    counters = dict(loop_state.get("counters", {}))
    counters.setdefault("dropped_stale", int(loop_state.get("dropped_stale", 0)))
    return counters


def _warm_start(cfg: ExperimentConfig, task: Any, model_dir: Path, out: Path) -> tuple[Path, dict | None]:
    """Supervised warm-start into ``<output_dir>/warm_start_model`` (reused when it exists: a
    crash after it, or a resume); returns the policy directory and the SFT metrics."""
    ws_dir = out / "warm_start_model"
    if (ws_dir / "config.json").exists():
        metrics_file = ws_dir / "sft_metrics.json"
        return ws_dir, json.loads(metrics_file.read_text()) if metrics_file.exists() else None
    if not cfg.warm_start.enabled:
        return model_dir, None
    w = cfg.warm_start
    key = cache_key(warm_start_cache_spec(cfg)) if w.cache_dir else ""
    if key:
        shutil.rmtree(ws_dir, ignore_errors=True)  # a half-written one from a crash
        if restore(w.cache_dir, key, ws_dir):  # the same warm-start, trained by an earlier run
            log.info("warm-start: reused %s", Path(w.cache_dir) / key)
            metrics = json.loads((ws_dir / "sft_metrics.json").read_text())
            metrics.update(reused_from=str(Path(w.cache_dir) / key), wall_s=0.0)
            (ws_dir / "sft_metrics.json").write_text(json.dumps(metrics))
            return ws_dir, metrics
    t0 = time.time()
    backend = plugin_settings(cfg, "learner.backend")  # the learner's speed knobs serve the SFT too
    autocast = getattr(backend, "autocast_dtype", None)
    # with autocast the weights stay float32 (a bf16 base would take AdamW's updates in bf16)
    actor, tok = load_model_and_tokenizer(model_dir, dtype=torch.float32 if autocast else
                                          getattr(torch, cfg.model.dtype),
                                          attn_implementation=cfg.model.attn_implementation)
    try:
        traces = task.warm_start_traces(w, progress=cfg.logging.progress)
    except InfrastructureError as e:  # a sandbox / retriever failure is not a bug of the run
        raise TrainingError(f"warm start: {e} (nothing trained yet; run again once it is back)") from e
    log.info("warm-start: %d traces in %.1f s", len(traces), time.time() - t0)
    threads = torch.get_num_threads()
    torch.set_num_threads(max(threads, os.cpu_count() or 1))  # nothing else computes during the SFT
    try:
        metrics = _train_warm_start(cfg, task, actor, tok, traces, backend)
    finally:
        torch.set_num_threads(threads)
    actor.save_pretrained(ws_dir)
    tok.save_pretrained(ws_dir)
    metrics["wall_s"] = time.time() - t0
    (ws_dir / "sft_metrics.json").write_text(json.dumps(metrics))
    if key:
        store(w.cache_dir, key, ws_dir)
    return ws_dir, metrics


def _train_warm_start(cfg: ExperimentConfig, task: Any, actor: torch.nn.Module, tok: Any, traces: list,
                      backend: Any) -> dict:
    """The task's copy drills (if any), then the warm-start proper, on ``actor`` in place; their SFT
    metrics (the drills' as ``sft/drill_*``). The warm-start's memory is checked before the drills
    run, so a warm-start that cannot fit is refused before any SFT step, not after the drills'.

    Raises:
        ConfigError: the warm-start or the drills would not fit this machine's memory (one line).
        ValueError: ``traces`` is empty.
    """
    from ..warmstart import sft_warm_start, tokenize_trace

    if not traces:
        raise ValueError("sft_warm_start: traces is empty")  # (as sft_warm_start says it, before max())
    w, agent_cfg = cfg.warm_start, agent_loop_config(cfg)
    autocast = getattr(backend, "autocast_dtype", None)
    longest = max(len(tokenize_trace(tok, t, agent_cfg)[0]) for t in traces)
    check_sft_memory(cfg, min(w.micro_batch_size or w.batch_size, w.batch_size), longest)
    drill = {}
    plan = task.drill_plan()  # the task's copy drills (its settings), if any
    if plan is not None:  # (computed in the weights' dtype, without autocast)
        drill_fits = functools.partial(check_sft_memory, cfg, phase="copy-drill warm-start", autocast=False)
        drills = task.drill_traces(plan.steps * plan.batch_size, w.seed)
        drill = sft_warm_start(actor, tok, drills, steps=plan.steps, batch_size=plan.batch_size,
                               lr=plan.lr, seed=w.seed, progress=cfg.logging.progress,
                               agent_cfg=agent_cfg, schedule="constant",
                               micro_batch_size=w.micro_batch_size, check_memory=drill_fits)
        drill = {k.replace("sft/", "sft/drill_"): v for k, v in drill.items()}
    metrics = sft_warm_start(actor, tok, traces, steps=w.steps, batch_size=w.batch_size, lr=w.lr,
                             seed=w.seed, progress=cfg.logging.progress, agent_cfg=agent_cfg,
                             schedule=w.schedule,
                             shared_prefix_tokens=getattr(backend, "shared_prefix_tokens", 0),
                             autocast_dtype=getattr(torch, autocast) if autocast else None,
                             micro_batch_size=w.micro_batch_size)
    metrics.update(drill)
    return metrics


def build_context(cfg: ExperimentConfig, resume: bool = False) -> RunContext:
    """Build the :class:`RunContext` of ``cfg`` (starting the task's services).

    Resume: the newest complete checkpoint restores the learner (models, optimizers,
    schedulers, counters), the prompt cursor (admitted-but-untrained prompts re-queued), RNG
    states, trained prompt draws and the cumulative counters; metrics logged after it are
    dropped and re-done.

    Raises:
        ConfigError: settings only checkable at start-up (the message names the key).
    """
    from ..config import to_yaml
    from ..tasks import build_task

    t_start = time.time()  # wall time counts set-up and warm-start too
    out = Path(cfg.output_dir)
    lock = lock_output_dir(out)  # one writer per run directory (exit 2 naming the holder's pid)
    (out / "config.yaml").write_text(to_yaml(cfg))
    if cfg.train.torch_threads:
        torch.set_num_threads(cfg.train.torch_threads)
    set_malloc_mmap_threshold(cfg.learner.malloc_mmap_threshold)  # the torch learner runs in this process
    seed_everything(cfg.train.seed)
    ckpt = CheckpointManager(out / "checkpoints", cfg.checkpoint.keep_last)
    try:
        found = ckpt.load_latest() if resume else None  # a torn checkpoint: warned about, skipped
    except CheckpointError as e:
        lock.close()
        raise ConfigError(f"--resume: {e}") from None
    state = found[1] if found else None
    if resume and state is None:
        log.warning("--resume: no checkpoint in %s; starting from scratch", out / "checkpoints")
    task = build_task(task_spec(cfg))
    learner = None
    try:
        if cfg.warm_start.enabled:
            task.check_warm_start(cfg.warm_start)  # before any model is loaded
        summary: dict[str, Any] = {"name": cfg.name, "preset": cfg.preset, "task": cfg.task.env,
                                   "max_staleness": cfg.max_staleness, "output_dir": str(out)}
        model_dir = initial_model_dir(cfg, out, task)
        check_chat_template(load_tokenizer(model_dir), cfg.rollout.use_chat_template, model_dir)
        model_dir, sft = _warm_start(cfg, task, model_dir, out) if state is None else \
            ((out / "warm_start_model", None) if (out / "warm_start_model" / "config.json").exists()
             else (model_dir, None))
        if sft is not None:
            summary["warm_start"] = sft
        learner = make_learner(learner_spec(cfg), model_dir)
        logger = MetricsLogger(out, tensorboard=cfg.logging.tensorboard, resume=state is not None)
        ctx = RunContext(cfg=cfg, out=out, task=task, model_dir=model_dir,
                         tokenizer=load_tokenizer(model_dir), learner=learner, logger=logger,
                         checkpoints=ckpt, resume_state=state,
                         prompts=PromptStream(task.train_samples, cfg.train.seed), summary=summary,
                         t_start=t_start, lock=lock)
    except BaseException:
        task.close()
        close_learner(learner)
        raise
    if state is not None:
        summary.update(state.get("summary", {}))
        try:
            restore_learner(learner, state)
        except BaseException:
            ctx.close()
            raise
        ctx.prompts.load_state_dict(state["loop"]["prompts"])
        ctx.start_step = int(state["loop"]["step"])
        ctx.trained_uids = list(state["trained_uids"])
        ctx.counters = saved_counters(state["loop"])
        set_rng_state(state["rng"])
        ctx.logger.truncate_after(ctx.start_step)
    return ctx
