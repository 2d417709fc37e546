"""Padded ``(B, ·)`` tensors from trajectories: the hand-off from rollout to learner."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import Any

import torch

from .trajectory import NO_VERSION, Trajectory

Tensor = torch.Tensor


@dataclass
class RolloutBatch:
    """A padded batch. Prompts are left-padded to ``P``, responses right-padded to ``T``.

    Response-aligned tensors (what :mod:`copc` takes) are ``(B, T)``; the full sequence
    fed to the model is ``input_ids = cat(prompt, response)`` of shape ``(B, P + T)``,
    so response token ``t`` sits at column ``P + t`` and is scored by the logits at
    column ``P + t − 1``.

    Attributes:
        input_ids: ``(B, P + T)`` int64 (pad id at padding).
        attention_mask: ``(B, P + T)`` int64 0/1.
        position_ids: ``(B, P + T)`` int64, ``cumsum(attention_mask) − 1`` clamped at 0.
        prompt_len: ``P`` (tokens).
        loss_mask: ``(B, T)`` float32, 1 on model tokens.
        logp_mu: ``(B, T)`` float32 behavior log-probs (0 off model tokens).
        versions: ``(B, T)`` int64 policy versions (:data:`NO_VERSION` off model tokens).
        rewards: ``(B, T)`` float32 per-token reward (:meth:`Trajectory.token_rewards`): each
            environment step's reward on the last model token of the turn it answered (a
            non-terminal step's reward before that step's observation, the terminal reward on
            the episode's last model token); 0 elsewhere, never on an observation or padding
            token. Row ``b`` sums to ``scores[b]`` (up to float32 rounding).
        scores: ``(B,)`` float32 episode returns (:attr:`Trajectory.reward`, the sum of the
            step rewards): the outcome score of critic-free estimators (GRPO/SAO/DAPO).
        group_ids: ``(B,)`` int64 prompt-group index (for GRPO).
        sample_ids: length-B list of data-row ids.
    """

    input_ids: Tensor
    attention_mask: Tensor
    position_ids: Tensor
    prompt_len: int
    loss_mask: Tensor
    logp_mu: Tensor
    versions: Tensor
    rewards: Tensor
    scores: Tensor
    group_ids: Tensor
    sample_ids: list[Any]

    @property
    def response_ids(self) -> Tensor:
        """``(B, T)`` response token ids."""
        return self.input_ids[:, self.prompt_len:]

    def __len__(self) -> int:
        return int(self.input_ids.shape[0])

    def select(self, idx: Sequence[int] | slice) -> RolloutBatch:
        """Rows ``idx`` as a new batch (for mini-/micro-batches); the padding is kept."""
        rows = list(range(len(self)))[idx] if isinstance(idx, slice) else list(idx)
        index = torch.tensor(rows, dtype=torch.long, device=self.input_ids.device)  # CUDA batches too
        out = {}
        for f in fields(self):
            v = getattr(self, f.name)
            if isinstance(v, torch.Tensor):
                out[f.name] = v.index_select(0, index)
            elif f.name == "sample_ids":
                out[f.name] = [v[i] for i in rows]
            else:
                out[f.name] = v
        return RolloutBatch(**out)

    def trimmed(self) -> RolloutBatch:
        """The same rows without the columns that are padding in every row: the leading prompt
        columns no row attends to and the response columns after the last attended one (a
        micro-batch of short episodes cut out of a batch with a long one). ``P`` and ``T`` shrink
        by the dropped columns; every real token keeps its column relative to the prompt end, so
        the forward pass over the trimmed batch gives each real token what it gives in the padded
        one (causal attention never reads a later column; padding is never attended), and
        :func:`pad_response` restores ``(B, T)`` outputs. A batch with no attended column is
        returned as is."""
        attended = self.attention_mask.bool().any(dim=0)
        cols = attended.nonzero()
        if len(cols) == 0:
            return self
        first, last = int(cols[0]), int(cols[-1]) + 1
        first = min(first, max(self.prompt_len - 1, 0))  # keep a prompt column: column 0 is never scored
        end = max(last - self.prompt_len, 1)  # keep >= 1 response column, as to_batch does
        if first == 0 and end == self.loss_mask.shape[1]:
            return self
        full = slice(first, self.prompt_len + end)
        out = {}
        for f in fields(self):
            v = getattr(self, f.name)
            if f.name in ("input_ids", "attention_mask", "position_ids"):
                out[f.name] = v[:, full]
            elif f.name in ("loss_mask", "logp_mu", "versions", "rewards"):
                out[f.name] = v[:, :end]
            else:
                out[f.name] = v
        out["prompt_len"] = self.prompt_len - first
        return RolloutBatch(**out)


def pad_response(x: Tensor, width: int) -> Tensor:
    """``(B, t)`` response-aligned values of a :meth:`RolloutBatch.trimmed` batch as ``(B, width)``
    (``width >= t``), zeros in the added columns (padding: never a model token)."""
    return x if x.shape[1] == width else torch.nn.functional.pad(x, (0, width - x.shape[1]))


def to_batch(trajectories: Sequence[Trajectory], pad_token_id: int) -> RolloutBatch:
    """Pad a list of trajectories into a :class:`RolloutBatch`.

    Args:
        trajectories: non-empty list.
        pad_token_id: id used at padding positions (never attended, never trained).

    Returns:
        The batch; group ids are renumbered ``0..G−1`` in order of first appearance.

    Raises:
        ValueError: on an empty list, or a trajectory whose rewards cannot be placed on its
            model tokens (a non-zero reward but no model token, or a step reward recorded at an
            index that is not a model token; see :meth:`Trajectory.token_rewards`).
    """
    if not trajectories:
        raise ValueError("to_batch: no trajectories")
    B = len(trajectories)
    P = max(len(t.prompt_ids) for t in trajectories)
    T = max(max(len(t.response_ids) for t in trajectories), 1)
    input_ids = torch.full((B, P + T), pad_token_id, dtype=torch.long)
    attn = torch.zeros(B, P + T, dtype=torch.long)
    loss_mask = torch.zeros(B, T, dtype=torch.float32)
    logp_mu = torch.zeros(B, T, dtype=torch.float32)
    versions = torch.full((B, T), NO_VERSION, dtype=torch.long)
    rewards = torch.zeros(B, T, dtype=torch.float32)
    groups: dict[Any, int] = {}
    group_ids = torch.zeros(B, dtype=torch.long)
    for b, tr in enumerate(trajectories):
        p, n = len(tr.prompt_ids), len(tr.response_ids)
        input_ids[b, P - p:P] = torch.tensor(tr.prompt_ids, dtype=torch.long)
        attn[b, P - p:P + n] = 1
        if n:
            input_ids[b, P:P + n] = torch.tensor(tr.response_ids, dtype=torch.long)
            loss_mask[b, :n] = torch.tensor(tr.loss_mask, dtype=torch.float32)
            logp_mu[b, :n] = torch.tensor(tr.logp_mu, dtype=torch.float32)
            versions[b, :n] = torch.tensor(tr.versions, dtype=torch.long)
        try:
            placed = tr.token_rewards()
        except ValueError as e:
            raise ValueError(f"trajectory {b}: {e}") from None
        if placed:
            rewards[b, list(placed)] = torch.tensor(list(placed.values()), dtype=torch.float32)
        key = tr.group_id if tr.group_id is not None else tr.sample_id
        group_ids[b] = groups.setdefault(key, len(groups))
    position_ids = (attn.cumsum(1) - 1).clamp(min=0)
    scores = torch.tensor([float(t.reward) for t in trajectories], dtype=torch.float32)
    return RolloutBatch(input_ids=input_ids, attention_mask=attn, position_ids=position_ids,
                        prompt_len=P, loss_mask=loss_mask, logp_mu=logp_mu, versions=versions,
                        rewards=rewards, scores=scores, group_ids=group_ids,
                        sample_ids=[t.sample_id for t in trajectories])
