"""Per-token log-probs and critic values from Megatron ``GPTModel`` s, vocab-parallel.

The log-prob convention is :func:`trainer.logprobs.token_logprobs` (the one definition shared
with the rollout engines): ``log softmax(logits / temperature)[token]`` in float32 from the raw
logits. Here the logits stay sharded over the tensor-parallel ranks (each holds ``V / tp``
vocabulary columns) and Megatron's ``vocab_parallel_cross_entropy`` computes
``logsumexp − logit[token]`` with two all-reduces over the tensor-parallel group (max, then
sums) — the full ``(B, L, V)`` logits are never gathered.

Alignment (as :mod:`trainer.learner.backends.torch`): response token ``t`` sits at column
``P + t`` and is scored by the logits at column ``P + t − 1``; the critic's value of the state
before response token ``t`` is read at column ``P + t − 1``.
"""

from __future__ import annotations

import torch
from torch import nn

from ....rollout.batch import RolloutBatch

Tensor = torch.Tensor


def attention_mask(pad_mask: Tensor) -> Tensor:
    """Megatron's attention mask of a padded batch: ``(B, 1, L, L)`` bool, True = masked out.

    Query ``i`` may attend key ``j`` iff ``j ≤ i`` (causal) and ``j`` is not padding. Always
    passed explicitly: Megatron's default causal mask (``attention_mask=None``) is built on
    ``device="cuda"`` and ignores padding.

    Args:
        pad_mask: ``(B, L)`` 0/1 (int or bool), 1 on real tokens (``RolloutBatch.attention_mask``).
    """
    L = pad_mask.shape[1]
    causal = torch.ones(L, L, dtype=torch.bool, device=pad_mask.device).tril()
    allowed = causal.unsqueeze(0) & pad_mask.bool().unsqueeze(1)
    return (~allowed).unsqueeze(1)


def model_outputs(model: nn.Module, b: RolloutBatch, device: torch.device) -> Tensor:
    """``GPTModel`` forward of a (micro-)batch without labels: ``(B, L, D)`` where ``D`` is the
    local vocabulary shard ``V / tp`` (actor) or 1 (critic with a value head)."""
    return model(input_ids=b.input_ids.to(device), position_ids=b.position_ids.to(device),
                 attention_mask=attention_mask(b.attention_mask.to(device)))


def vocab_parallel_logprobs(logits: Tensor, token_ids: Tensor, temperature: float = 1.0) -> Tensor:
    """Log-probs of ``token_ids`` under ``softmax(logits / temperature)`` with the vocabulary
    sharded over the tensor-parallel group.

    Args:
        logits: ``(..., V / tp)`` this rank's vocabulary shard (any float dtype; computed in fp32).
        token_ids: ``(...)`` int64 global vocabulary ids.
        temperature: > 0.

    Returns:
        ``(...)`` float32 log-probs, equal on every tensor-parallel rank; differentiable.

    Raises:
        ValueError: ``temperature <= 0`` or mismatched leading shapes.
    """
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature!r}")
    if logits.shape[:-1] != token_ids.shape:
        raise ValueError(f"logits {tuple(logits.shape)} and token_ids {tuple(token_ids.shape)} "
                         "must share leading dimensions")
    # A fresh fp32 tensor: vocab_parallel_cross_entropy works in place on its input.
    scaled = (logits.float() / temperature if temperature != 1.0 else logits.float().clone()).contiguous()
    return -vocab_parallel_cross_entropy(scaled, token_ids)


def response_logprobs(model: nn.Module, b: RolloutBatch, temperature: float, device: torch.device) -> Tensor:
    """``(B, T)`` float32 log-probs of the response tokens (token ``t`` scored at column ``P + t − 1``)."""
    P = b.prompt_len
    logits = model_outputs(model, b, device)
    return vocab_parallel_logprobs(logits[:, P - 1:-1], b.input_ids[:, P:].to(device), temperature)


def response_values(critic: nn.Module, b: RolloutBatch, device: torch.device) -> Tensor:
    """``(B, T)`` float32 critic values ``V(s_t)`` of the states before each response token."""
    v = model_outputs(critic, b, device).squeeze(-1).float()
    return v[:, b.prompt_len - 1:-1]
