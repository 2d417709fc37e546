"""Scripted-output logits processor for tests (forces a model's text, not its log-probs)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch


def scripted(tokenizer, actions: Sequence[str], turn_of: Callable[[str], int]
             ) -> Callable[[list[int], list[int], torch.Tensor], torch.Tensor]:
    """A sampling-only logits processor that forces ``actions[turn]`` then EOS.

    ``turn_of(decoded_prompt)`` says which scripted action the current request is for.
    Raw logits (and so the behavior log-probs) are untouched by construction.
    """
    encoded = [[*tokenizer.encode(a, add_special_tokens=False), tokenizer.eos_token_id] for a in actions]

    def proc(prompt_ids: list[int], new_ids: list[int], logits: torch.Tensor) -> torch.Tensor:
        script = encoded[turn_of(tokenizer.decode(prompt_ids))]
        out = torch.full_like(logits, -1e9)
        out[script[min(len(new_ids), len(script) - 1)]] = 0.0
        return out

    return proc


def runs(tr, masked: bool) -> list[list[int]]:
    """Maximal runs of response ids with ``loss_mask == masked``."""
    out, cur = [], []
    for t, m in zip(tr.response_ids, tr.loss_mask, strict=True):
        if bool(m) == masked:
            cur.append(t)
        elif cur:
            out.append(cur)
            cur = []
    return out + ([cur] if cur else [])
