"""The memory check before a run loads any model: estimate, log, refuse when it cannot fit.

:func:`memory_plan` reads the experiment config into a
:class:`~trainer.models.memory_estimate.MemoryPlan` (the config is read here, in the app layer);
:func:`check_memory` compares its estimate with the machine's available memory and refuses in one
line naming the setting to change, instead of an OOM kill minutes into the run.
"""

from __future__ import annotations

import dataclasses
import logging
import sys
from dataclasses import dataclass
from pathlib import Path

from ..config import ExperimentConfig, plugin_metadata, plugin_settings
from ..errors import ConfigError
from ..models.memory_estimate import (
    DTYPE_BYTES,
    GIB,
    MachineMemory,
    MemoryEstimate,
    MemoryPlan,
    ModelDims,
    estimate_memory,
    machine_memory,
)

log = logging.getLogger(__name__)

#: KV-cache slots the embedded engine keeps beyond ``rollout.engine_max_batch_size`` (its
#: ``EmbeddedEngineConfig.park_slots`` default).
PARK_SLOTS = 8
#: Engines whose weights and KV cache live in this run's processes (the others are servers).
IN_PROCESS_ENGINES = ("embedded",)


def _dims(cfg: ExperimentConfig) -> ModelDims:
    """The model's shape: ``model.path``'s ``config.json``, else the tiny model's spec."""
    if cfg.model.path:
        return ModelDims.from_model_dir(Path(cfg.model.path))
    t = cfg.model.tiny
    if t.tokenizer == "bpe":
        vocab = t.vocab_size
    else:
        from ..models.tiny import build_byte_tokenizer
        vocab = len(build_byte_tokenizer())
    return ModelDims(vocab=vocab, hidden=t.hidden_size,
                     intermediate=t.intermediate_size, layers=t.num_layers, heads=t.num_heads,
                     kv_heads=t.num_kv_heads, qkv_bias=t.arch == "qwen2")


def _read_dims(cfg: ExperimentConfig) -> ModelDims:
    """:func:`_dims`, its failures as one :class:`ConfigError` naming ``model.path``."""
    try:
        return _dims(cfg)
    except (OSError, KeyError, ValueError) as e:
        raise ConfigError(f"model.path={cfg.model.path!r}: cannot read its config.json for the memory "
                          f"estimate ({type(e).__name__}: {e})") from None


def memory_plan(cfg: ExperimentConfig) -> MemoryPlan:
    """The :class:`MemoryPlan` of ``cfg``: the learner's micro-batch at ``rollout.max_total_tokens``
    (the longest a row can be), its dtypes, LoRA, checkpointing and attention, and one in-process
    engine per rollout process (``launcher.settings.num_rollout_workers`` with the Ray launcher)
    with ``rollout.engine_max_batch_size`` + :data:`PARK_SLOTS` KV slots of that length.

    Raises:
        ConfigError: ``model.path`` has no readable ``config.json`` with the fields the estimate needs.
    """
    dims = _read_dims(cfg)
    backend = plugin_settings(cfg, "learner.backend")
    autocast = getattr(backend, "autocast_dtype", None)
    actor, critic = cfg.learner.lora_settings()
    remote = bool(plugin_metadata(cfg, "launcher.kind").get("rollout_workers", False))
    workers = int(getattr(plugin_settings(cfg, "launcher.kind"), "num_rollout_workers", 1)) if remote else 1
    engines = workers if cfg.rollout.engine in IN_PROCESS_ENGINES else 0
    param_bytes = DTYPE_BYTES[cfg.model.dtype]
    return MemoryPlan(
        dims=dims, param_bytes=param_bytes, act_bytes=2 if autocast or param_bytes == 2 else 4,
        mixed_precision=bool(autocast) and param_bytes == 4,
        lora_rank=actor.rank if actor else 0, lora_targets=tuple(actor.target_modules) if actor else (),
        critic_lora_rank=critic.rank if critic else 0,
        critic_lora_targets=tuple(critic.target_modules) if critic else (),
        critic=cfg.algorithm_config().use_critic, micro_batch=cfg.train.micro_batch_size,
        seq_len=cfg.rollout.max_total_tokens,
        gradient_checkpointing=bool(getattr(backend, "gradient_checkpointing", False)),
        attn=cfg.model.attn_implementation, chunk_tokens=int(getattr(backend, "logprob_chunk_tokens", 512)),
        engines=engines, engine_slots=cfg.rollout.engine_max_batch_size + PARK_SLOTS,
        engine_seq_len=cfg.rollout.max_total_tokens,
        processes=1 + (workers if remote else 0))


def sft_memory_plan(cfg: ExperimentConfig, rows: int, seq_len: int, autocast: bool = True) -> MemoryPlan:
    """The :class:`MemoryPlan` of the supervised warm-start's largest forward: a full fine-tune of
    ``model.path`` (float32 weights when the learner has an ``autocast_dtype``, else ``model.dtype``;
    no critic, no engine: the SFT runs before either exists) on ``rows`` rows of ``seq_len`` tokens.
    ``autocast``: that SFT computes under the learner's ``autocast_dtype`` (False: the copy drills,
    which compute in the weights' dtype).

    Raises:
        ConfigError: ``model.path`` has no readable ``config.json`` with the fields the estimate needs.
    """
    dims = _read_dims(cfg)
    learner_autocast = getattr(plugin_settings(cfg, "learner.backend"), "autocast_dtype", None)
    param_bytes = 4 if learner_autocast else DTYPE_BYTES[cfg.model.dtype]
    mixed = bool(learner_autocast) and autocast
    return MemoryPlan(dims=dims, param_bytes=param_bytes, act_bytes=2 if mixed else param_bytes,
                      mixed_precision=mixed, critic=False, micro_batch=rows, seq_len=seq_len,
                      attn=cfg.model.attn_implementation, engines=0, processes=1)


def _sft_fix(cfg: ExperimentConfig, plan: MemoryPlan, limit: int) -> str:
    """The largest ``warm_start.micro_batch_size`` (at most ``warm_start.batch_size``) whose
    estimate fits ``limit`` bytes, or the other settings when not even one trace per forward fits."""
    for m in range(min(plan.micro_batch - 1, cfg.warm_start.batch_size), 0, -1):
        if estimate_memory(dataclasses.replace(plan, micro_batch=m)).total <= limit:
            return f"warm_start.micro_batch_size={m}"
    return ("model.attn_implementation=sdpa" if plan.attn == "eager" else
            "a smaller model or shorter traces (not even one trace per forward fits)")


def check_sft_memory(cfg: ExperimentConfig, rows: int, seq_len: int, machine: MachineMemory | None = None,
                     *, phase: str = "warm-start", autocast: bool = True) -> MemoryEstimate | None:
    """Refuse a warm-start whose largest forward (``rows`` rows of ``seq_len`` tokens: a
    micro-batch of its longest traces) cannot fit, before its first step.

    Args:
        cfg: the validated experiment config. rows: traces per forward
            (``warm_start.micro_batch_size``, else ``batch_size``). seq_len: the longest trace, tokens.
        machine: the memory to compare with; None: :func:`machine_memory`.
        phase: the SFT's name in the messages (``warm-start``, or the task's ``copy drills``).
        autocast: see :func:`sft_memory_plan`.

    Returns:
        The estimate (None: the model's config could not be read; nothing checked).

    Raises:
        ConfigError: the estimate exceeds the machine's limit and ``learner.memory_check`` is on:
            one line with both figures and the largest ``warm_start.micro_batch_size`` that fits.
    """
    try:
        plan = sft_memory_plan(cfg, rows, seq_len, autocast)
    except ConfigError as e:
        log.warning("%s memory estimate skipped: %s", phase, e)
        return None
    est = estimate_memory(plan)
    mem = machine if machine is not None else machine_memory()
    what = f"{rows} traces x {seq_len} tokens per forward"
    if est.total > mem.limit and cfg.learner.memory_check:
        fix = _sft_fix(cfg, plan, mem.limit)
        raise ConfigError(
            f"memory: the {phase} needs ~{est.total / GIB:.1f} GiB at its peak ({what}; {est.line()}) but "
            f"this machine has {mem.limit / GIB:.1f} GiB ({mem.source}); change: {fix} "
            "(or learner.memory_check=false to start anyway)")
    print(f"{phase} memory estimate: {est.line()} ({what})", file=sys.stderr, flush=True)
    return est


def _advice(cfg: ExperimentConfig, plan: MemoryPlan) -> str:
    """The settings to change, most effective first, as ``key=value`` (one line)."""
    fixes = []
    if plan.attn == "eager":
        fixes.append("model.attn_implementation=sdpa (eager keeps a B x heads x T x T matrix per layer)")
    if not plan.gradient_checkpointing and plan.dims.layers > 1:
        fixes.append("learner.backend_settings.gradient_checkpointing=true")
    if plan.micro_batch > 1:
        fixes.append(f"train.micro_batch_size={max(1, plan.micro_batch // 2)}")
    fixes.append(f"rollout.max_total_tokens={max(64, cfg.rollout.max_total_tokens // 2)}")
    if plan.param_bytes == 4 and plan.lora_rank:
        fixes.append("model.dtype=bfloat16")
    return "; ".join(fixes)


@dataclass(frozen=True)
class MemoryCheck:
    """A passed check: the estimate (None: the model's config could not be read, nothing checked)
    and its one-line report (:meth:`report` prints it)."""

    estimate: MemoryEstimate | None
    line: str

    def report(self) -> None:
        """Print :attr:`line` on stderr, as the run's other start-up lines (no logging handler
        prints INFO); ``copc train`` does once the run directory is its own."""
        print(self.line, file=sys.stderr, flush=True)


def check_memory(cfg: ExperimentConfig, machine: MachineMemory | None = None) -> MemoryCheck:
    """Estimate ``cfg``'s peak memory; refuse when it exceeds what the run may ever use, warn when it
    exceeds what is free now.

    The refusal compares with the limit (the cgroup's, else ``MemTotal``), not with what is free at
    start-up: the estimate is a worst case (every row of a micro-batch at ``rollout.max_total_tokens``)
    and other jobs' memory comes and goes, so a run that fits the machine is only warned about.

    Args:
        cfg: the validated experiment config.
        machine: the memory to compare with; None: :func:`machine_memory` (this process's).

    Returns:
        The :class:`MemoryCheck` (the estimate and its report line ``memory estimate: ...``).

    Raises:
        ConfigError: the estimate exceeds the limit and ``learner.memory_check`` is on: one line
            with both figures and the settings to change. A ``model.path`` whose ``config.json``
            lacks the fields the estimate reads is not refused: a warning, and no check.
    """
    try:
        plan = memory_plan(cfg)
    except ConfigError as e:  # a model family the estimate cannot read: say so, never refuse on it
        log.warning("memory estimate skipped: %s", e)
        return MemoryCheck(None, f"memory estimate: skipped ({e})")
    est = estimate_memory(plan)
    mem = machine if machine is not None else machine_memory()
    what = (f"micro-batch {plan.micro_batch} x {plan.seq_len} tokens, {plan.attn} attention, gradient "
            f"checkpointing {'on' if plan.gradient_checkpointing else 'off'}")
    if est.total > mem.limit and cfg.learner.memory_check:
        raise ConfigError(
            f"memory: this run needs ~{est.total / GIB:.1f} GiB at its peak ({what}; {est.line()}) but this "
            f"machine has {mem.limit / GIB:.1f} GiB ({mem.source}); change: {_advice(cfg, plan)} "
            "(or learner.memory_check=false to start anyway)")
    if est.total > mem.limit:
        log.warning("memory estimate %.1f GiB exceeds this machine's %.1f GiB (%s); "
                    "learner.memory_check=false: starting anyway",
                    est.total / GIB, mem.limit / GIB, mem.source)
    elif est.total > mem.available:
        log.warning("memory estimate %.1f GiB (at worst: every row at rollout.max_total_tokens) exceeds the "
                    "%.1f GiB free now (other processes hold the rest): the run may be OOM-killed; to need "
                    "less: %s", est.total / GIB, mem.available / GIB, _advice(cfg, plan))
    return MemoryCheck(est, f"memory estimate: {est.line()} ({what}); {mem.available / GIB:.1f} GiB "
                            f"available of {mem.limit / GIB:.1f} GiB ({mem.source})")
