"""Decoder hidden states of a batch whose rows begin with the same tokens, with that common prefix
run once (``learner.backend_settings.shared_prefix_tokens`` of the torch backend).

A few-shot prompt is most of every sequence of the search main job (~440 of ~570 tokens, the same
in every row). :func:`decoder_hidden_states` finds the longest prefix the rows' real tokens share
(:func:`common_prefix_len`), runs the decoder on it for one row (keeping its keys and values), repeats
those keys and values across the batch and runs every row's remaining tokens once, attending to
them. The result is the ``(B, L, H)`` tensor the plain forward gives, in the same layout, so every
caller (the actor's chunked log-probs, the critic's values) is unchanged; gradients flow through the
shared keys and values into the prefix's forward (summed over the rows), so the step's gradients are
the plain forward's: the same computation, regrouped (up to float rounding, as any change of batch
shape). Columns before a row's first real token (left padding) are 0; nothing reads them.

The causal attention of a decoder-only model makes this exact: a prefix's hidden states and keys and
values do not depend on what follows it. Models whose forward keeps no key/value cache (the decoder
does not fill the ``cache`` it is given) are refused with a ``ValueError`` naming the model.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers.cache_utils import DynamicCache

Tensor = torch.Tensor


def common_prefix_len(input_ids: Tensor, attention_mask: Tensor) -> tuple[int, Tensor]:
    """The number of leading real tokens every row shares, and each row's first real column.

    Args:
        input_ids / attention_mask: ``(B, L)`` int64; rows left-padded (a row's real tokens start at
            its first 1 of ``attention_mask``; right padding after them is allowed).

    Returns:
        ``(C, starts)``: ``C`` the length of the longest common run of tokens at the rows' starts
        (within every row's real tokens; 0 for an empty batch), ``starts`` ``(B,)`` int64.
    """
    b, length = input_ids.shape
    if b == 0:
        return 0, torch.zeros(0, dtype=torch.long)
    starts = attention_mask.argmax(dim=1)
    real = attention_mask.sum(dim=1)
    limit = int(real.min())
    cols = starts[:, None] + torch.arange(limit, device=input_ids.device)[None, :]
    aligned = input_ids.gather(1, cols.clamp(max=length - 1))
    same = (aligned == aligned[:1]).all(dim=0)
    mismatch = (~same).nonzero()
    return (int(mismatch[0]) if len(mismatch) else limit), starts


def decoder_hidden_states(decoder: nn.Module, input_ids: Tensor, attention_mask: Tensor,
                          position_ids: Tensor, min_shared: int) -> Tensor:
    """``(B, L, H)`` last hidden states of ``decoder`` (a ``transformers`` base model: the
    ``last_hidden_state`` of its forward), the rows' common prefix run once when it has at least
    ``min_shared`` tokens (and the batch at least 2 rows); otherwise the plain forward.

    Args:
        decoder: e.g. ``LlamaModel`` (a causal LM's ``get_decoder()``, LoRA layers inside allowed).
        input_ids / attention_mask / position_ids: ``(B, L)`` int64, left-padded prompts followed by
            right-padded responses (:class:`~trainer.rollout.batch.RolloutBatch`); ``position_ids``
            count real tokens from 0 in each row.
        min_shared: shortest common prefix worth sharing (tokens, >= 1; 0 turns sharing off).

    Returns:
        ``(B, L, H)`` in the decoder's output dtype; 0 at the columns before each row's first real
        token.

    Raises:
        ValueError: the decoder did not fill the key/value cache of the prefix (naming its class).
    """
    b, length = input_ids.shape
    c, starts = common_prefix_len(input_ids, attention_mask) if min_shared > 0 and b > 1 else (0, None)
    if c:  # every row keeps >= 1 token after the prefix (the rest's forward is never empty)
        c = min(c, int(attention_mask.sum(dim=1).min()) - 1)
    if c < max(min_shared, 1):
        return decoder(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                       use_cache=False).last_hidden_state
    # one row's prefix: columns [s_0, s_0 + C) of row 0, positions 0 .. C-1
    s0 = int(starts[0])
    cache = DynamicCache()
    pre = decoder(input_ids=input_ids[:1, s0:s0 + c], position_ids=position_ids[:1, s0:s0 + c],
                  cache=cache, use_cache=True)
    if cache.get_seq_length() != c:
        raise ValueError(f"{type(decoder).__name__}: the forward did not fill the key/value cache it was "
                         "given; learner.backend_settings.shared_prefix_tokens needs one (set it to 0)")
    cache.batch_repeat_interleave(b)
    # every row's remaining tokens, right-aligned at column C (a row's own padding kept as 0s)
    rest_len = length - starts - c                       # (B,) tokens after the prefix, padding incl.
    r = int(rest_len.max())
    j = torch.arange(r, device=input_ids.device)[None, :]
    src = (starts[:, None] + c + j).clamp(max=length - 1)
    valid = j < rest_len[:, None]
    rest_ids = torch.where(valid, input_ids.gather(1, src), input_ids[:1, :1])
    rest_mask = torch.where(valid, attention_mask.gather(1, src), 0)
    rest_pos = torch.where(valid, position_ids.gather(1, src), 0)
    full_mask = torch.cat([rest_mask.new_ones(b, c), rest_mask], dim=1)
    out = decoder(input_ids=rest_ids, attention_mask=full_mask, position_ids=rest_pos,
                  cache=cache, use_cache=True).last_hidden_state
    h_pre = pre.last_hidden_state
    hidden = out.new_zeros(b, length, out.shape[-1])
    pre_cols = starts[:, None] + torch.arange(c, device=input_ids.device)[None, :]
    hidden = hidden.scatter(1, pre_cols[..., None].expand(-1, -1, out.shape[-1]),
                            h_pre.expand(b, -1, -1).to(out.dtype))
    rows, cols = valid.nonzero(as_tuple=True)
    return hidden.index_put((rows, src[rows, cols]), out[rows, cols])
