"""Supervised warm-start (cold start) on scripted traces: next-token loss on action tokens only.

Tokenisation is the agent loop's (:func:`trainer.rollout.agent_loop.run_episode`): the prompt
is encoded alone with :func:`~trainer.rollout.agent_loop.encode_prompt`, then each piece is
encoded alone (no special tokens) and appended; observations are cut to
``AgentLoopConfig.max_observation_tokens``; the final action is followed by EOS (how a
model ends its answer). The tokens enter a :class:`~trainer.rollout.trajectory.Trajectory`
through the same chokepoint as a rollout's (:func:`trace_trajectory`), so the loss mask is the
one the RL learner uses: 1 on action tokens and that EOS, 0 on prompt and observation tokens.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ..models.lm_head import token_scores
from ..rollout.agent_loop import AgentLoopConfig, encode_prompt, observation_ids
from ..rollout.observation import ChatTurns
from ..rollout.trajectory import NO_VERSION, Trajectory


def trace_trajectory(tokenizer: Any, trace: tuple[str, Sequence[tuple[str, str]]],
                     agent_cfg: AgentLoopConfig | None = None) -> Trajectory:
    """The :class:`~trainer.rollout.trajectory.Trajectory` of one trace, built as the agent loop
    builds a rollout's: the same chokepoint sets the loss mask (model tokens 1, observation 0).

    The prompt is encoded alone (:func:`~trainer.rollout.agent_loop.encode_prompt`); each action
    is encoded alone (no special tokens; the final one followed by EOS, how a model ends its
    answer) and appended with :meth:`Trajectory.append_model_tokens` (behaviour log-prob 0.0,
    version :data:`~trainer.rollout.trajectory.NO_VERSION`: scripted, no policy sampled them);
    each observation is cut to ``max_observation_tokens``
    (:func:`~trainer.rollout.observation.truncate_observation_ids`) and appended with
    :meth:`Trajectory.append_observation_tokens`.

    Args:
        tokenizer: the policy's tokenizer (with ``eos_token_id``).
        trace: ``(prompt, [(kind, text), ...])``, kind ``"action"`` or ``"observation"``.
        agent_cfg: :class:`AgentLoopConfig` (``use_chat_template``, ``max_observation_tokens``).

    Returns:
        The trajectory (no reward; ``turns`` = number of actions).

    Raises:
        ValueError: unknown piece kind, no pieces, or a last piece that is not an action.
    """
    cfg = agent_cfg or AgentLoopConfig()
    prompt, pieces = trace
    if not pieces or pieces[-1][0] != "action":
        raise ValueError(f"trace pieces must end with an action, got kinds {[k for k, _ in pieces]}")
    chat = ChatTurns(tokenizer, system=cfg.system_prompt) if cfg.use_chat_template else None
    traj = Trajectory(prompt_ids=chat.prompt_ids(prompt) if chat else encode_prompt(tokenizer, prompt, False))
    last: int | None = None
    for i, (kind, text) in enumerate(pieces):
        if kind == "action":
            toks = list(tokenizer.encode(text, add_special_tokens=False))
            if i == len(pieces) - 1:
                toks.append(tokenizer.eos_token_id)
            traj.append_model_tokens(toks, [0.0] * len(toks), NO_VERSION)
            last = toks[-1] if toks else last
        elif kind == "observation":
            traj.append_observation_tokens(observation_ids(tokenizer, chat, cfg, text, after_token=last))
        else:
            raise ValueError(f"trace piece {i}: kind={kind!r} must be 'action' or 'observation'")
    return traj


def tokenize_trace(tokenizer: Any, trace: tuple[str, Sequence[tuple[str, str]]],
                   agent_cfg: AgentLoopConfig | None = None) -> tuple[list[int], list[int]]:
    """Token ids and loss mask of one trace, exactly as the agent loop would build them.

    Args:
        tokenizer: the policy's tokenizer (with ``eos_token_id``).
        trace: ``(prompt, [(kind, text), ...])``, kind ``"action"`` or ``"observation"``.
        agent_cfg: :class:`AgentLoopConfig` (``use_chat_template``, ``max_observation_tokens``).

    Returns:
        ``(input_ids, loss_mask)`` of :func:`trace_trajectory`'s trajectory
        (:meth:`Trajectory.sequence`): equal-length int lists over prompt + response; the mask is
        1 exactly on action tokens and the EOS after the final action.

    Raises:
        ValueError: unknown piece kind, no pieces, or a last piece that is not an action.
    """
    return trace_trajectory(tokenizer, trace, agent_cfg).sequence()


def _batch(rows: list[tuple[list[int], list[int]]], pad_id: int) -> tuple[torch.Tensor, ...]:
    """Right-padded ``(input_ids, attention_mask, loss_mask)`` ``(B, L)`` int64 tensors."""
    L = max(len(r[0]) for r in rows)
    ids = torch.full((len(rows), L), pad_id, dtype=torch.long)
    attn = torch.zeros((len(rows), L), dtype=torch.long)
    lm = torch.zeros((len(rows), L), dtype=torch.long)
    for i, (x, m) in enumerate(rows):
        ids[i, : len(x)] = torch.tensor(x)
        attn[i, : len(x)] = 1
        lm[i, : len(m)] = torch.tensor(m)
    return ids, attn, lm


def action_token_loss(model: torch.nn.Module, ids: torch.Tensor, attn: torch.Tensor,
                      loss_mask: torch.Tensor, shared_prefix_tokens: int = 0,
                      num_tokens: int | None = None) -> torch.Tensor:
    """Mean next-token cross-entropy (nats per token) over positions with ``loss_mask == 1``.

    ``num_tokens``: divide the summed cross-entropy by this instead of the count of those
    positions (a micro-batch's share of its batch's mean: the whole batch's count).

    Token ``i`` is predicted from the model's distribution at ``i - 1``. Args are ``(B, L)`` int64
    tensors (right padding); returns a scalar float32 tensor (differentiable). The output head is
    applied only at the predicting positions of loss tokens, in chunks of tokens
    (:func:`trainer.models.lm_head.token_scores` at temperature 1): with long tool observations,
    most positions need no logits, and the ``(N, V)`` logits of the others are never held at once.
    ``shared_prefix_tokens``: a common prefix of the rows of at least this many tokens (a few-shot
    prompt) is run once for the batch (:mod:`trainer.models.shared_prefix`; 0: the plain forward).

    Raises:
        ValueError: a model the chunked head cannot score (:func:`trainer.models.lm_head.output_head`).
    """
    keep = loss_mask.bool().clone()
    keep[:, 0] = False  # nothing predicts the first token
    pos = (attn.long().cumsum(1) - 1).clamp(min=0)
    logp, _ = token_scores(model, ids, attn, pos, keep, shared_prefix_tokens=shared_prefix_tokens)
    return -logp.sum() / (keep.sum().clamp(min=1) if num_tokens is None else max(num_tokens, 1))


def _predicted(row: tuple[list[int], list[int]]) -> int:
    """Loss tokens of one ``(ids, loss_mask)`` row that something predicts (all but a masked-in first)."""
    return sum(row[1]) - (row[1][0] if row[1] else 0)


def _sft_step(model: torch.nn.Module, opt: torch.optim.Optimizer, rows: list[tuple[list[int], list[int]]],
              pad: int, micro: int, shared_prefix_tokens: int, autocast_dtype: torch.dtype | None,
              max_grad_norm: float) -> float:
    """One optimizer step on ``rows``: ``micro`` rows per forward/backward (each micro-batch padded
    to its own longest row), gradients accumulated so the step's loss is the mean over every
    row's action tokens, as one forward of all rows would give. Returns that loss (nats/token)."""
    total = sum(_predicted(r) for r in rows)
    opt.zero_grad(set_to_none=True)
    loss_sum = 0.0
    for i in range(0, len(rows), micro):
        ids, attn, lm = _batch(rows[i:i + micro], pad)
        with torch.autocast("cpu", dtype=autocast_dtype or torch.bfloat16,
                            enabled=autocast_dtype is not None):
            loss = action_token_loss(model, ids, attn, lm, shared_prefix_tokens, num_tokens=total)
        loss.backward()
        loss_sum += float(loss.detach())
    torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
    opt.step()
    return loss_sum


def _check_sft_args(traces: Sequence[Any], steps: Any, batch_size: Any, lr: Any, schedule: str) -> None:
    """Raise ``ValueError`` naming the argument of :func:`sft_warm_start` that is bad."""
    if not traces:
        raise ValueError("sft_warm_start: traces is empty")
    if not isinstance(steps, int) or steps < 1:
        raise ValueError(f"sft_warm_start: steps={steps!r} must be an int >= 1")
    if not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"sft_warm_start: batch_size={batch_size!r} must be an int >= 1")
    if not lr > 0:
        raise ValueError(f"sft_warm_start: lr={lr!r} must be > 0")
    if schedule not in ("cosine", "constant"):
        raise ValueError(f"sft_warm_start: schedule={schedule!r} must be 'cosine' or 'constant'")


def lr_schedule(schedule: str, steps: int, warmup_frac: float) -> Callable[[int], float]:
    """The LR factor of step ``i`` (0-based; multiplies the peak LR) of :func:`sft_warm_start`.

    ``"cosine"``: linear warm-up over ``w = max(1, int(warmup_frac * steps))`` steps,
    ``(i + 1) / w``, then ``0.1 + 0.45 (1 + cos(pi t))`` with ``t = (i - w) / max(1, steps - w)``
    (cosine decay to 0.1); ``"constant"``: ``(i + 1) / 20`` for the first 20 steps, then 1.
    """
    warm = max(1, int(warmup_frac * steps)) if schedule == "cosine" else 20

    def lr_factor(step: int) -> float:
        if step < warm:
            return (step + 1) / warm
        if schedule == "constant":
            return 1.0
        t = (step - warm) / max(1, steps - warm)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t))

    return lr_factor


def sft_warm_start(model: torch.nn.Module, tokenizer: Any, traces: Sequence[tuple[str, Any]], *,
                   steps: int, batch_size: int, lr: float, seed: int, progress: bool = True,
                   agent_cfg: AgentLoopConfig | None = None, weight_decay: float = 0.0,
                   warmup_frac: float = 0.05, max_grad_norm: float = 1.0, schedule: str = "cosine",
                   on_step: Callable[[int, float], None] | None = None, shared_prefix_tokens: int = 0,
                   autocast_dtype: torch.dtype | None = None, micro_batch_size: int = 0,
                   check_memory: Callable[[int, int], None] | None = None) -> dict[str, float]:
    """Supervised warm start: AdamW on the action-token next-token loss of ``traces``.

    Batches are drawn without replacement from a seeded permutation (reshuffled each epoch).
    LR schedule (``schedule``): ``"cosine"`` — linear warmup over ``warmup_frac * steps``
    steps, then cosine decay to ``0.1 * lr``; ``"constant"`` — linear warmup over 20 steps,
    then constant (so a run of N steps equals the first N steps of any longer run).
    Gradients are clipped to ``max_grad_norm``. The model is trained in place and left in
    eval mode.

    Args:
        model: causal LM (``transformers``), float32.
        tokenizer: its tokenizer.
        traces: ``(prompt, pieces)`` traces (:class:`~trainer.warmstart.traces.Trace`).
        steps: optimizer steps (>= 1). batch_size: traces per step (>= 1). lr: peak LR (> 0).
        seed: shuffling seed.
        progress: show a tqdm bar with the loss.
        agent_cfg: the agent loop's config (chat template, observation cut), so SFT sees the
            same tokens as rollouts.
        on_step: optional ``f(step, loss)`` called after each step (loss in nats/token).
        shared_prefix_tokens: run a common prefix of a batch's traces (a few-shot prompt) once
            (:func:`action_token_loss`; 0: off).
        autocast_dtype: compute the forward and backward in this dtype on the float32 weights
            (``torch.autocast``, e.g. ``torch.bfloat16``: ~1.4-2x faster on an AVX512-bf16 CPU;
            the learner's ``autocast_dtype``); None: the weights' dtype.
        micro_batch_size: traces per forward/backward, gradients accumulated over the step's
            batch (same loss and update up to float rounding); 0: the whole batch at once.
        check_memory: called once before the first step with ``(traces per forward, longest
            trace in tokens)``, the worst forward the run can meet; it raises to refuse.

    Returns:
        ``{"sft/loss_first", "sft/loss_last" (mean of the last ``min(10, steps)`` steps),
        "sft/steps", "sft/seconds", "sft/action_tokens" (per epoch), "sft/traces"}``.

    Raises:
        ValueError: on empty ``traces`` or a bad ``steps`` / ``batch_size`` / ``micro_batch_size`` /
            ``lr``, or a trace longer than the model's context (``max_position_embeddings``).
    """
    from ..outputs.progress import phase_bar

    _check_sft_args(traces, steps, batch_size, lr, schedule)
    rows = [tokenize_trace(tokenizer, t, agent_cfg) for t in traces]
    max_len = int(getattr(model.config, "max_position_embeddings", 1 << 30))
    for i, (x, _) in enumerate(rows):
        if len(x) > max_len:
            raise ValueError(f"sft_warm_start: trace {i} has {len(x)} tokens, more than the model's "
                             f"{max_len}-token context")
    if not isinstance(micro_batch_size, int) or micro_batch_size < 0:
        raise ValueError(f"sft_warm_start: micro_batch_size={micro_batch_size!r} must be an int >= 0")
    micro = min(micro_batch_size or batch_size, batch_size)
    if check_memory is not None:
        check_memory(micro, max(len(x) for x, _ in rows))
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_schedule(schedule, steps, warmup_frac))
    order: list[int] = []
    losses: list[float] = []
    model.train()
    t0 = time.perf_counter()
    bar = phase_bar(range(steps), desc="sft warm-start", show=progress, leave=False)
    try:
        for step in bar:
            if len(order) < batch_size:
                order += torch.randperm(len(rows), generator=gen).tolist()
            idx, order = order[:batch_size], order[batch_size:]
            losses.append(_sft_step(model, opt, [rows[i] for i in idx], pad, micro, shared_prefix_tokens,
                                    autocast_dtype, max_grad_norm))
            sched.step()
            bar.set_postfix(loss=f"{losses[-1]:.3f}")
            if on_step is not None:
                on_step(step, losses[-1])
    finally:
        bar.close()
        model.eval()
    tail = losses[-min(10, len(losses)):]
    return {"sft/loss_first": losses[0], "sft/loss_last": sum(tail) / len(tail),
            "sft/steps": float(steps), "sft/seconds": time.perf_counter() - t0,
            "sft/action_tokens": float(sum(sum(m) for _, m in rows)), "sft/traces": float(len(rows))}
