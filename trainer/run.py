"""The main job: ``copc train`` — warm-start, evaluate, asynchronous RL, evaluate, report.

``run_experiment(cfg, resume)`` does, in order: build or load the model (tiny
offline models go through the same ``model.path`` code as real checkpoints), the
task (environment factory, data, sandbox / retriever services), an optional
supervised warm-start on generated traces, a held-out evaluation, asynchronous
RL with the configured preset (checkpointed, resumable), a second evaluation,
then plots, ``summary.json`` and a printed before/after table.
"""

from __future__ import annotations

import asyncio
import copy
import json
import logging
import random
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .checkpoint import CheckpointManager, rng_state, set_rng_state
from .config import ConfigError, ExperimentConfig, to_yaml
from .engines.base import SamplingParams
from .learner.torch_learner import LearnerConfig, TorchLearner
from .metrics_log import MetricsLogger, write_summary
from .models.loading import load_model_and_tokenizer
from .models.tiny import TinyModelConfig, save_tiny_checkpoint
from .orchestration.loop import AsyncTrainingLoop, make_loop_config
from .orchestration.prompts import PromptStream
from .progress import TrainProgress
from .rollout.agent_loop import AgentLoopConfig
from .tasks import Task, build_task

log = logging.getLogger(__name__)


def seed_everything(seed: int) -> None:
    """Seed python, numpy and torch."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def initial_model_dir(cfg: ExperimentConfig, out: Path) -> Path:
    """``model.path``, or a tiny model built once into ``<output_dir>/init_model``."""
    if cfg.model.path:
        return Path(cfg.model.path)
    d = out / "init_model"
    if not (d / "config.json").exists():
        save_tiny_checkpoint(d, TinyModelConfig(**vars(cfg.model.tiny)))
    return d


def agent_config(cfg: ExperimentConfig) -> AgentLoopConfig:
    """Episode budgets from the rollout section."""
    r = cfg.rollout
    return AgentLoopConfig(max_total_tokens=r.max_total_tokens, max_turns=r.max_turns,
                           max_observation_tokens=r.max_observation_tokens,
                           use_chat_template=r.use_chat_template)


def build_engine(cfg: ExperimentConfig, model: torch.nn.Module, tokenizer: Any, version: int = 0):
    """The rollout engine of ``rollout.engine`` (embedded: owns a copy of the actor)."""
    if cfg.rollout.engine == "embedded":
        from .engines.embedded import EmbeddedEngine, EmbeddedEngineConfig
        return EmbeddedEngine(model, tokenizer, EmbeddedEngineConfig(
            max_batch_size=cfg.rollout.engine_max_batch_size), version=version)
    raise NotImplementedError("use build_engine_async for rollout.engine='sglang'")


async def open_engine(cfg: ExperimentConfig, model: torch.nn.Module, tokenizer: Any, out: Path,
                      version: int = 0) -> tuple[Any, Any, Any]:
    """Start the rollout engine; return ``(engine, sync_weights, close)``.

    ``sync_weights(actor, version)`` pushes the learner's weights: the embedded engine copies
    the state dict in memory; SGLang (GPU) gets a ``save_pretrained`` directory through
    ``/update_weights_from_disk``.
    """
    if cfg.rollout.engine == "embedded":
        engine = build_engine(cfg, model, tokenizer, version)

        async def sync(actor: torch.nn.Module, v: int) -> None:
            await engine.update_weights(actor.state_dict(), v)

        return engine, sync, engine.close
    from .engines.sglang import SGLangEngine, SGLangEngineConfig
    from .engines.sglang_launcher import SGLangLauncher, SGLangLauncherConfig

    model_dir = out / "sglang_weights" / f"v{version}"
    model.save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    launcher = SGLangLauncher(SGLangLauncherConfig(model_path=str(model_dir), port=cfg.rollout.sglang_port,
                                                   tp=cfg.rollout.sglang_tp,
                                                   mem_fraction_static=cfg.rollout.sglang_mem_fraction))
    await asyncio.to_thread(launcher.start)
    engine = SGLangEngine(SGLangEngineConfig(base_url=launcher.url, initial_version=version))

    async def sync_disk(actor: torch.nn.Module, v: int) -> None:
        d = out / "sglang_weights" / f"v{v}"
        await asyncio.to_thread(actor.save_pretrained, d)
        await engine.update_weights(str(d), v)

    async def close() -> None:
        await engine.close()
        await asyncio.to_thread(launcher.close)

    return engine, sync_disk, close


def build_traces(kind: str, task: Task, n: int, seed: int, progress: bool = True,
                 kinds: tuple[str, ...] = (), tool_use_fraction: float = 1.0) -> list:
    """Warm-start traces from the task's real environment, disjoint from the held-out set.

    ``retool_arithmetic``: generated problems from their own seed stream (held-out problems
    filtered out); a ``tool_use_fraction`` of them solved with one ``<code>`` call whose
    output is copied into ``\boxed{}``, the rest answered from the head (an estimate), in a
    seeded order. ``search_r1``: the first ``n`` training questions.
    """
    from .warmstart import direct_answer_traces, retool_arithmetic_samples, retool_traces, search_r1_traces

    held = {s.get("problem", s.get("question")) for s in task.eval_samples}
    if kind == "retool_arithmetic":
        pool = retool_arithmetic_samples(n + len(held), seed=10_000 + seed,
                                         kinds=kinds or ("mul", "sum_of_products", "mul_minus"))
        samples = [s for s in pool if s["problem"] not in held][:n]
        n_tool = round(tool_use_fraction * len(samples))
        traces = retool_traces(samples[:n_tool], task.make_env, progress=progress)
        traces += direct_answer_traces(samples[n_tool:], task.make_env, progress=progress)
        random.Random(seed).shuffle(traces)
        return traces
    samples = [s for s in task.train_samples if s["question"] not in held][:n]
    return search_r1_traces(samples, task.make_env, progress=progress)


def _warm_start(cfg: ExperimentConfig, task: Task, actor, tok, out: Path) -> dict:
    """Supervised warm-start (skipped if its result already exists: resume after a crash)."""
    from .warmstart import sft_warm_start

    ws_dir = out / "warm_start_model"
    if (ws_dir / "config.json").exists():
        actor.load_state_dict(load_model_and_tokenizer(ws_dir)[0].state_dict())
        return json.loads((ws_dir / "sft_metrics.json").read_text())
    w = cfg.warm_start
    t0 = time.time()
    traces = build_traces(w.kind, task, w.num_examples, seed=w.seed, progress=cfg.logging.progress,
                          kinds=tuple(cfg.task.arithmetic_kinds), tool_use_fraction=w.tool_use_fraction)
    log.info("warm-start: %d traces in %.1f s", len(traces), time.time() - t0)
    metrics = sft_warm_start(actor, tok, traces, steps=w.steps, batch_size=w.batch_size, lr=w.lr,
                             seed=w.seed, progress=cfg.logging.progress, agent_cfg=agent_config(cfg),
                             schedule=w.schedule)
    actor.save_pretrained(ws_dir)
    tok.save_pretrained(ws_dir)
    (ws_dir / "sft_metrics.json").write_text(json.dumps(metrics))
    return metrics


async def _evaluate(cfg: ExperimentConfig, engine, task: Task, tok) -> dict:
    from .evaluation import evaluate

    return await evaluate(engine, task.make_env, tok, task.eval_samples, k=cfg.eval.k,
                          temperature=cfg.eval.temperature, agent_cfg=agent_config(cfg),
                          max_new_tokens=cfg.rollout.max_new_tokens, seed=cfg.train.seed)


def run_experiment(cfg: ExperimentConfig, resume: bool = False) -> dict:
    """Run (or resume) the experiment described by ``cfg``; return the summary dict.

    Resume: the newest complete checkpoint in ``<output_dir>/checkpoints`` restores models,
    optimizers, schedulers, RNG states, the prompt cursor (admitted-but-untrained prompts are
    re-queued) and the step count; metrics logged after it are dropped and re-done.
    """
    if cfg.rollout.engine == "sglang":
        import importlib.util

        if importlib.util.find_spec("sglang") is None or not torch.cuda.is_available():
            raise ConfigError("rollout.engine='sglang' needs a CUDA GPU and the sglang package "
                              "(pip install -e .[gpu]); use rollout.engine=embedded on CPU")
    out = Path(cfg.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    if resume and (out / "summary.json").exists():
        done = CheckpointManager(out / "checkpoints").latest()
        if done is not None and CheckpointManager.step_of(done) >= cfg.train.total_steps:
            summary = json.loads((out / "summary.json").read_text())
            log.warning("--resume: the run in %s already finished %d steps; nothing to do",
                        out, cfg.train.total_steps)
            print_report(summary)
            return summary
    (out / "config.yaml").write_text(to_yaml(cfg))
    t_start = time.time()
    algo = cfg.algorithm_config()
    if cfg.train.torch_threads:
        torch.set_num_threads(cfg.train.torch_threads)
    seed_everything(cfg.train.seed)
    ckpt = CheckpointManager(out / "checkpoints", cfg.checkpoint.keep_last)
    state = ckpt.load() if resume else None
    if resume and state is None:
        log.warning("--resume: no checkpoint in %s; starting from scratch", out / "checkpoints")
    task = build_task(cfg)
    logger = MetricsLogger(out, tensorboard=cfg.logging.tensorboard, resume=state is not None)
    summary: dict[str, Any] = {"name": cfg.name, "preset": cfg.preset, "task": cfg.task.env,
                               "max_staleness": cfg.max_staleness, "output_dir": str(out)}
    try:
        actor, tok = load_model_and_tokenizer(initial_model_dir(cfg, out),
                                              dtype=getattr(torch, cfg.model.dtype),
                                              attn_implementation=cfg.model.attn_implementation)
        if cfg.model.gradient_checkpointing:
            actor.gradient_checkpointing_enable()
        if cfg.warm_start.enabled and state is None:
            t0 = time.time()
            summary["warm_start"] = _warm_start(cfg, task, actor, tok, out)
            summary["warm_start"]["wall_s"] = time.time() - t0
        elif state is not None:
            summary.update(state.get("summary", {}))
        learner = TorchLearner(actor, algo, LearnerConfig(
            actor_lr=cfg.train.actor_lr, critic_lr=cfg.train.critic_lr, weight_decay=cfg.train.weight_decay,
            warmup_steps=cfg.train.warmup_steps, grad_clip=cfg.train.grad_clip,
            critic_warmup_steps=cfg.train.critic_warmup_steps, num_mini_batches=cfg.train.num_mini_batches,
            micro_batch_size=cfg.train.micro_batch_size, temperature=cfg.rollout.temperature,
            seed=cfg.train.seed))
        prompts = PromptStream(task.train_samples, cfg.train.seed)
        start_step = 0
        trained_uids: list[int] = []
        counters: dict[str, int] = {}
        if state is not None:
            learner.load_state_dict(state["learner"])
            prompts.load_state_dict(state["loop"]["prompts"])
            start_step = int(state["loop"]["step"])
            trained_uids = list(state["trained_uids"])
            counters = _saved_counters(state["loop"])
            set_rng_state(state["rng"])
            logger.truncate_after(start_step)
        summary["wall_s_before_resume"] = float(summary.get("wall_s_before_resume", 0.0))
        summary["_t_start"] = t_start
        asyncio.run(_eval_rl_eval(cfg, algo, learner, copy.deepcopy(actor).eval(), tok, task, prompts,
                                  start_step, trained_uids, logger, ckpt, summary, out, counters))
        del summary["_t_start"]
        summary["wall_s"] = time.time() - t_start + summary["wall_s_before_resume"]
        rows = logger.read()
        if cfg.logging.plots:
            from .plots import make_plots
            summary["plots"] = [str(p) for p in make_plots(rows, out)]
        write_summary(out, summary)
        print_report(summary)
        return summary
    finally:
        logger.close()
        task.close()


def _resumable_summary(summary: dict) -> dict:
    """What a checkpoint keeps of the summary: evaluation before RL, warm-start metrics and the
    wall time spent so far (seconds, summed over resumes)."""
    kept = {k: v for k, v in summary.items() if k in ("eval_before", "warm_start")}
    kept["wall_s_before_resume"] = summary["wall_s_before_resume"] + time.time() - summary["_t_start"]
    return kept


def _saved_counters(loop_state: dict) -> dict[str, int]:
    """Cumulative counters of a checkpoint's loop state (older checkpoints: dropped_stale only)."""
    counters = dict(loop_state.get("counters", {}))
    counters.setdefault("dropped_stale", int(loop_state.get("dropped_stale", 0)))
    return counters


async def _eval_rl_eval(cfg, algo, learner, engine_model, tok, task, prompts, start_step, trained_uids,
                        logger, ckpt, summary, out, counters=None) -> None:
    """Evaluation before RL, the RL phase, evaluation after, on one event loop and one engine."""
    engine, sync, close = await open_engine(cfg, engine_model, tok, out, version=start_step)
    try:
        if start_step:
            await sync(learner.actor, start_step)
        if cfg.eval.enabled and "eval_before" not in summary:
            summary["eval_before"] = await _evaluate(cfg, engine, task, tok)
            logger.log(start_step, {f"eval/{k}": v for k, v in summary["eval_before"].items()
                                    if isinstance(v, int | float)})
        summary.update(await _rl(cfg, algo, learner, engine, sync, task, tok, prompts, start_step,
                                 trained_uids, logger, ckpt, summary, counters or {}))
        if cfg.eval.enabled:
            summary["eval_after"] = await _evaluate(cfg, engine, task, tok)
            # one metrics line per step: the after-RL evaluation is its own row after the last step
            logger.log(cfg.train.total_steps + 1, {f"eval/{k}": v for k, v in summary["eval_after"].items()
                                                   if isinstance(v, int | float)})
    finally:
        await close()


async def _rl(cfg, algo, learner, engine, sync, task, tok, prompts, start_step, trained_uids, logger, ckpt,
              summary, counters) -> dict:
    """The asynchronous RL phase; returns RL summary fields (counters cumulative over resumes)."""
    loop_cfg = make_loop_config(cfg, algo)
    r = cfg.rollout
    sampling = SamplingParams(temperature=r.temperature, top_p=r.top_p, top_k=r.top_k,
                              max_new_tokens=r.max_new_tokens, seed=cfg.train.seed)
    progress = TrainProgress(cfg.train.total_steps, start_step, enabled=cfg.logging.progress)
    t0 = time.time()

    def on_step(step: int, metrics: dict, uids: list[int]) -> None:
        trained_uids.extend(uids)
        scalars = {k: v for k, v in metrics.items() if isinstance(v, int | float)}
        per_token = metrics.get("staleness/per_token")  # staleness of every trained model token
        if per_token:
            scalars["staleness/token_mean"] = float(np.mean(per_token))
            # logged as counts per staleness level (index = policy versions behind)
            scalars["staleness/hist"] = np.bincount(np.asarray(per_token, dtype=np.int64)).tolist()
        logger.log(step, scalars)
        progress.update(step, scalars, time.time() - t0)

    def on_checkpoint(step: int, loop_state: dict) -> None:
        ckpt.save(step, {"learner": learner.state_dict(), "loop": loop_state, "rng": rng_state(),
                         "trained_uids": list(trained_uids),
                         "summary": _resumable_summary(summary)})

    if cfg.launcher.kind == "ray":  # rollout workers + learner as Ray actors (same loop semantics)
        from .orchestration.ray_launcher import run_ray_rl
        with progress:
            loop = await run_ray_rl(cfg, learner, initial_model_dir(cfg, Path(cfg.output_dir)), task, tok,
                                    prompts, sampling, agent_config(cfg), loop_cfg, start_step=start_step,
                                    on_step=on_step, on_checkpoint=on_checkpoint, counters=counters)
        await sync(learner.actor, loop.version)  # the driver's engine (evaluation) gets the final weights
    else:
        loop = AsyncTrainingLoop(learner, engine, task.make_env, tok, prompts, sampling, agent_config(cfg),
                                 loop_cfg, on_step=on_step, on_checkpoint=on_checkpoint,
                                 start_step=start_step, sync_weights=sync, counters=counters)
        with progress:
            await loop.run()
    c = loop.counters
    return {"rl_wall_s": time.time() - t0, "steps": loop.step, "dropped_stale": c["dropped_stale"],
            "episodes": c["episodes"], "episodes_trained": c["episodes_trained"],
            "tokens_generated": c["tokens_generated"], "tokens_trained": c["tokens_trained"],
            "infra_failed": c["infra_failed"], "infra_failed_groups": c["infra_failed_groups"],
            "trained_uids": len(trained_uids),
            "duplicate_trained_uids": len(trained_uids) - len(set(trained_uids))}


def print_report(summary: dict) -> None:
    """Print the before/after table (rich) and where the outputs are."""
    from rich.console import Console
    from rich.table import Table

    con = Console()
    table = Table(title=f"{summary.get('name')} — {summary.get('preset')} on {summary.get('task')}")
    table.add_column("metric")
    table.add_column("after warm-start (before RL)", justify="right")
    table.add_column("after RL", justify="right")
    before, after = summary.get("eval_before", {}), summary.get("eval_after", {})
    for k in sorted(set(before) | set(after)):
        if isinstance(before.get(k, after.get(k)), int | float):
            table.add_row(k, _fmt(before.get(k)), _fmt(after.get(k)))
    con.print(table)
    con.print(f"RL steps: {summary.get('steps')}, episodes: {summary.get('episodes')}, dropped as stale: "
              f"{summary.get('dropped_stale')}, infrastructure failures: {summary.get('infra_failed', 0)}, "
              f"wall time: {summary.get('wall_s', 0):.0f} s; "
              f"outputs in {summary.get('output_dir')}")


def _fmt(v: Any) -> str:
    return "—" if v is None else (f"{v:.3f}" if isinstance(v, float) else str(v))


def run_evaluation(cfg: ExperimentConfig, checkpoint: str | None = None) -> dict:
    """Standalone evaluation (``copc eval``).

    ``checkpoint``: a model directory (``save_pretrained``) or a training checkpoint directory;
    None: the run's latest checkpoint, else its initial model (``model.path`` / tiny / warm-start).
    """
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
    print(f"copc eval: evaluating {path}")
    task = build_task(cfg)
    try:
        if (path / "config.json").exists():
            model, tok = load_model_and_tokenizer(path)
        else:  # a training checkpoint directory
            model, tok = load_model_and_tokenizer(initial_model_dir(cfg, out))
            state = CheckpointManager(path.parent, 1).load(path)
            if state is None:
                raise ConfigError(f"{path}: neither a model directory nor a complete checkpoint")
            model.load_state_dict(state["learner"]["actor"])
        res = asyncio.run(_standalone_eval(cfg, model.eval(), tok, task, out))
        print(json.dumps(res, indent=2))
        return res
    finally:
        task.close()


async def _standalone_eval(cfg: ExperimentConfig, model, tok, task: Task, out: Path) -> dict:
    engine, _, close = await open_engine(cfg, model, tok, out)
    try:
        return await _evaluate(cfg, engine, task, tok)
    finally:
        await close()
