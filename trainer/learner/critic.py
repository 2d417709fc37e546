"""The critic: the actor's transformer backbone with a scalar value head."""

from __future__ import annotations

import copy

import torch
from torch import nn

from ..models.shared_prefix import decoder_hidden_states

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

    def forward(self, input_ids: Tensor, attention_mask: Tensor, position_ids: Tensor,
                shared_prefix_tokens: int = 0) -> Tensor:
        """``(B, L)`` float32 values of every prefix (the head runs in its own dtype: float32 on a
        bfloat16 LoRA backbone, :func:`~trainer.learner.lora.prepare_models`); a common prefix of
        the rows of at least ``shared_prefix_tokens`` tokens is run once
        (:func:`~trainer.models.shared_prefix.decoder_hidden_states`; 0: the plain forward)."""
        h = decoder_hidden_states(self.backbone, input_ids, attention_mask, position_ids,
                                  shared_prefix_tokens)
        return self.value_head(h.to(self.value_head.weight.dtype)).squeeze(-1).float()

    def response_values(self, input_ids: Tensor, attention_mask: Tensor, position_ids: Tensor,
                        prompt_len: int, shared_prefix_tokens: int = 0) -> Tensor:
        """``(B, T)`` values ``V(s_t)`` of the states before each response token
        (``shared_prefix_tokens``: see :meth:`forward`)."""
        v = self(input_ids, attention_mask, position_ids, shared_prefix_tokens)
        return v[:, prompt_len - 1:-1]


#: Names of the attention sub-module of a decoder layer: Hugging Face Llama / Qwen / Mistral
#: (``self_attn``), GPT-2 (``attn``), BERT-style and Megatron (``attention``, ``self_attention``).
ATTENTION_MODULE_NAMES = ("self_attn", "attn", "attention", "self_attention")


def freeze_attention(critic: nn.Module, key: str = "learner.backend_settings.critic_freeze_attention") -> int:
    """Stop training the critic's attention parameters (SAO's critic recipe, arXiv 2607.07508):
    every parameter under a module whose own name is one of :data:`ATTENTION_MODULE_NAMES` gets
    ``requires_grad=False`` (LoRA adapters on attention projections included), so the optimiser
    built afterwards from the trainable parameters leaves them as loaded.

    Returns:
        The number of parameter tensors frozen.

    Raises:
        ValueError: the model has no such module (one line naming ``key``).
    """
    frozen = 0
    for name, module in critic.named_modules():
        if name.rsplit(".", 1)[-1] in ATTENTION_MODULE_NAMES:
            for p in module.parameters():
                frozen += int(p.requires_grad)
                p.requires_grad_(False)
    if frozen == 0:
        raise ValueError(f"{key}: the critic has no trainable attention module (looked for modules "
                         f"named {list(ATTENTION_MODULE_NAMES)})")
    return frozen
