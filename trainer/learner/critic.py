"""The critic: the actor's transformer backbone with a scalar value head."""

from __future__ import annotations

import copy

import torch
from torch import nn

Tensor = torch.Tensor


class ValueModel(nn.Module):
    """``V(s)`` for every prefix: backbone hidden state → ``Linear(hidden, 1)``.

    ``forward(...)[:, i]`` is the value of the state after tokens ``0..i``, i.e. the
    state *before* token ``i + 1``; so the value of response token ``t`` (at column
    ``P + t``) is read at column ``P + t − 1`` (explicit alignment, see
    :meth:`response_values`).

    Args:
        backbone: a ``transformers`` base model returning ``last_hidden_state`` ``(B, L, H)``.
        hidden_size: ``H``.
    """

    def __init__(self, backbone: nn.Module, hidden_size: int) -> None:
        super().__init__()
        self.backbone = backbone
        self.value_head = nn.Linear(hidden_size, 1)
        nn.init.zeros_(self.value_head.weight)
        nn.init.zeros_(self.value_head.bias)

    @classmethod
    def from_causal_lm(cls, lm: nn.Module, share_parameters: bool = False) -> ValueModel:
        """A critic initialised from a causal LM's backbone (deep copy) with a zero value head.

        Args:
            share_parameters: the copy's modules hold the LM's own parameter tensors instead of
                copies (one set of frozen base weights for a LoRA actor and a LoRA critic: their
                adapters and the value head are the critic's own). Only when both stay frozen.
        """
        backbone = lm.get_decoder() if hasattr(lm, "get_decoder") else lm.base_model
        p = next(lm.parameters())
        memo = {id(q): q for q in backbone.parameters()} if share_parameters else {}
        critic = cls(copy.deepcopy(backbone, memo), int(lm.config.hidden_size))
        return critic.to(device=p.device, dtype=p.dtype)

    def forward(self, input_ids: Tensor, attention_mask: Tensor, position_ids: Tensor) -> Tensor:
        """``(B, L)`` float32 values of every prefix (the head runs in its own dtype: float32 on a
        bfloat16 LoRA backbone, :func:`~trainer.learner.lora.prepare_models`)."""
        h = self.backbone(input_ids=input_ids, attention_mask=attention_mask,
                          position_ids=position_ids).last_hidden_state
        return self.value_head(h.to(self.value_head.weight.dtype)).squeeze(-1).float()

    def response_values(self, input_ids: Tensor, attention_mask: Tensor, position_ids: Tensor,
                        prompt_len: int) -> Tensor:
        """``(B, T)`` values ``V(s_t)`` of the states before each response token."""
        v = self(input_ids, attention_mask, position_ids)
        return v[:, prompt_len - 1:-1]
