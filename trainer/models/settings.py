"""The model layer's settings and defaults that a config's validation reads, importable without
torch: :class:`LoraSettings` (one model's LoRA adapter) with its ``target_modules`` names, and
the default log-prob chunk size.

:mod:`trainer.models.lora` and :mod:`trainer.models.chunked_logprobs` (the torch code using them)
re-export them; import them from there or from here.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

#: Default tokens per chunk (``learner.backend_settings.logprob_chunk_tokens``,
#: :func:`trainer.models.chunked_logprobs.chunked_token_scores`): with a 49k vocabulary a chunk's
#: float32 logits are 100 MB; with 151k, 310 MB.
DEFAULT_CHUNK_TOKENS = 512
#: ``target_modules`` default: the attention and MLP projections of Llama / Qwen2 / Mistral models.
DEFAULT_TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
#: The one-entry ``target_modules`` that adapts every linear layer but the output layer (peft's value).
ALL_LINEAR = "all-linear"
#: Input-embedding module names refused in ``target_modules`` before any model is loaded (peft would
#: put an embedding adapter there that the learner never trains, and save the whole embedding matrix
#: with the adapter); other non-linear targets are refused at model load
#: (:func:`trainer.models.lora.check_target_modules`).
EMBEDDING_TARGETS = ("embed_tokens",)


@dataclass(frozen=True)
class LoraSettings:
    """One model's LoRA adapter (validated).

    Attributes:
        rank: ``r``, the inner dimension of ``B A`` (int >= 1).
        alpha: ``lora_alpha``; the update is scaled by ``alpha / rank`` (> 0).
        dropout: dropout on the adapter's input in training mode, in ``[0, 1)`` (none in eval mode,
            where log-probs are recomputed and rollouts generated).
        target_modules: names of the linear layers to adapt, matched as peft matches them (a module
            whose name is the entry or ends in ``.<entry>``), or ``("all-linear",)``; never an
            input embedding (:data:`EMBEDDING_TARGETS`).

    Raises:
        ValueError: ``<field>=<value>: <why>`` (a config prefixes the section's key), e.g.
            ``target_modules=['q_proj', 'embed_tokens']: 'embed_tokens' is the input embedding, ...``.
    """

    rank: int = 8
    alpha: float = 16.0
    dropout: float = 0.0
    target_modules: tuple[str, ...] = DEFAULT_TARGET_MODULES

    def __post_init__(self) -> None:
        """Validate every field."""
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank < 1:
            raise ValueError(f"rank={self.rank!r}: must be an int >= 1")
        if not (isinstance(self.alpha, int | float) and math.isfinite(self.alpha) and self.alpha > 0):
            raise ValueError(f"alpha={self.alpha!r}: must be a finite number > 0")
        if not (isinstance(self.dropout, int | float) and 0.0 <= self.dropout < 1.0):
            raise ValueError(f"dropout={self.dropout!r}: must be in [0, 1)")
        mods = self.target_modules
        if isinstance(mods, str) or not mods or not all(isinstance(m, str) and m for m in mods):
            raise ValueError(f"target_modules={list(mods) if isinstance(mods, tuple) else mods!r}: must be a "
                             "non-empty list of module names")
        if ALL_LINEAR in mods and len(mods) > 1:
            raise ValueError(f"target_modules={list(mods)!r}: {ALL_LINEAR!r} stands alone")
        emb = next((m for m in mods if m in EMBEDDING_TARGETS), None)
        if emb is not None:
            raise ValueError(f"target_modules={list(mods)!r}: {emb!r} is the input embedding, not a linear "
                             "layer: its adapter would never be trained (tied to lm_head on tied models) and "
                             "the whole embedding matrix would be sent in every adapter-only sync")
        object.__setattr__(self, "target_modules", tuple(mods))

    @property
    def scaling(self) -> float:
        """``alpha / rank``: the factor of ``B A`` in the adapted layers."""
        return float(self.alpha) / self.rank

    def peft_config(self) -> Any:
        """The :class:`peft.LoraConfig` of these settings (no bias, no rsLoRA / DoRA)."""
        from peft import LoraConfig

        targets = ALL_LINEAR if self.target_modules == (ALL_LINEAR,) else list(self.target_modules)
        return LoraConfig(r=self.rank, lora_alpha=self.alpha, lora_dropout=float(self.dropout),
                          target_modules=targets, bias="none")

    def to_dict(self) -> dict[str, Any]:
        """Plain ``{rank, alpha, dropout, target_modules}`` (checkpoints, payloads)."""
        return {**dataclasses.asdict(self), "target_modules": list(self.target_modules)}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> LoraSettings:
        """The inverse of :meth:`to_dict`."""
        return cls(rank=int(d["rank"]), alpha=float(d["alpha"]), dropout=float(d["dropout"]),
                   target_modules=tuple(d["target_modules"]))
