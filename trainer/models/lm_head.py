"""A ``transformers`` causal LM split into its decoder body and its output head, so that token
log-probs can be taken at a few positions without the full ``(B, L, V)`` logits.

:func:`token_scores` runs the decoder (``model.get_decoder()``: the base model, final norm
included) to get hidden states, keeps the rows of the positions to score, and applies the output
head and the log-softmax in chunks (:func:`trainer.models.chunked_logprobs.chunked_token_scores`).
It serves a plain ``LlamaForCausalLM`` / ``Qwen2ForCausalLM`` and a ``peft`` ``PeftModel``
wrapping one (LoRA layers live inside the decoder; the wrapper forwards ``get_decoder``,
``get_output_embeddings`` and ``config``). The numbers are those of ``model(...).logits``
followed by :func:`trainer.logprobs.token_logprobs` (same operations; the head's matmul over
fewer rows may round differently in the last bit).

Logit transforms a model's head applies after the linear layer: a constant multiplier is honoured
(Cohere ``logit_scale``, Granite ``1 / logits_scaling``); soft-capping (Gemma 2/3
``final_logit_softcapping``), a head that is not a plain ``nn.Linear`` (e.g. LoRA on ``lm_head``)
and prompt-learning adapters (virtual tokens added by the wrapper's forward) are refused with a
``ValueError`` (:func:`output_head`); :func:`check_output_head` verifies on a short input that the
split gives the model's own logits, for any other transform an architecture may hide.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from .chunked_logprobs import DEFAULT_CHUNK_TOKENS, chunk_logits, chunked_token_scores
from .shared_prefix import decoder_hidden_states

Tensor = torch.Tensor


@dataclass(frozen=True)
class OutputHead:
    """The LM head as ``logits = scale · (h Wᵀ + bias)``.

    Attributes:
        weight: ``(V, H)`` (the module's own parameter: tied to the input embeddings when the
            model ties them). bias: ``(V,)`` or None. scale: the constant logit multiplier.
    """

    weight: Tensor
    bias: Tensor | None
    scale: float


def _text_config(model: nn.Module):
    cfg = model.config
    return cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg


def output_head(model: nn.Module) -> OutputHead:
    """The output head of ``model`` (a causal LM or a ``PeftModel`` wrapping one).

    Raises:
        ValueError: a model this split cannot score exactly, naming why: logit soft-capping, an
            output head that is not a plain ``nn.Linear``, or a prompt-learning ``peft`` adapter.
    """
    name = type(model).__name__
    peft_cfg = getattr(model, "active_peft_config", None)
    if peft_cfg is not None and getattr(peft_cfg, "is_prompt_learning", False):
        raise ValueError(f"{name}: a prompt-learning peft adapter ({type(peft_cfg).__name__}) adds virtual "
                         "tokens in the wrapper's forward; the chunked log-prob path runs the decoder itself "
                         "and cannot score it (use LoRA)")
    cfg = _text_config(model)
    cap = getattr(cfg, "final_logit_softcapping", None)
    if cap:
        raise ValueError(f"{name}: final_logit_softcapping={cap!r} (tanh soft-capped logits) is not "
                         "supported by the chunked log-prob path")
    head = model.get_output_embeddings()
    if type(head) is not nn.Linear:
        raise ValueError(f"{name}: output head {type(head).__name__} is not a plain nn.Linear (an adapter "
                         "on lm_head?); the chunked log-prob path needs its weight")
    multiplier = float(getattr(cfg, "logit_scale", None) or 1.0)  # Cohere: logits · logit_scale
    divisor = float(getattr(cfg, "logits_scaling", None) or 1.0)  # Granite: logits / logits_scaling
    scale = multiplier / divisor
    return OutputHead(head.weight, head.bias, scale)


def final_hidden_states(model: nn.Module, input_ids: Tensor, attention_mask: Tensor,
                        position_ids: Tensor, shared_prefix_tokens: int = 0) -> Tensor:
    """``(B, L, H)`` hidden states after the decoder's final norm: the output head's input.

    Args:
        model: a causal LM (or a ``PeftModel`` wrapping one) with ``get_decoder()``.
        input_ids / attention_mask / position_ids: ``(B, L)`` int64 (left padding allowed).
        shared_prefix_tokens: run a common prefix of the rows of at least this many tokens once
            (:func:`~trainer.models.shared_prefix.decoder_hidden_states`); 0: the plain forward.
    """
    return decoder_hidden_states(model.get_decoder(), input_ids, attention_mask, position_ids,
                                 shared_prefix_tokens)


def token_scores(model: nn.Module, input_ids: Tensor, attention_mask: Tensor, position_ids: Tensor,
                 score_mask: Tensor, *, temperature: float = 1.0, chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
                 entropy: bool = False, shared_prefix_tokens: int = 0, top_k: int = -1,
                 top_p: float = 1.0) -> tuple[Tensor, Tensor | None]:
    """Log-probs (and entropies) of the tokens at the columns ``score_mask`` selects, each token
    ``input_ids[b, i]`` scored by the model's distribution at column ``i − 1``.

    The same values as ``token_logprobs(model(...).logits[:, :-1], input_ids[:, 1:],
    temperature, top_k=top_k, top_p=top_p)`` at those columns, computed from the selected hidden
    states only, the head applied ``chunk_tokens`` rows at a time (forward and backward).

    Args:
        model: see :func:`output_head` (refused there when unsupported).
        input_ids / attention_mask / position_ids: ``(B, L)`` int64.
        score_mask: ``(B, L)`` bool, the columns whose token to score (column 0 must be false:
            nothing predicts it).
        temperature: > 0. chunk_tokens: >= 1.
        entropy: also the entropy (nats) of each scored position's distribution at ``temperature``.
        shared_prefix_tokens: see :func:`final_hidden_states`.
        top_k / top_p: the rollout's truncation (log-probs over the sampler's renormalised
            support, :func:`~trainer.models.chunked_logprobs.chunked_token_scores`; -1 / 1: none).

    Returns:
        ``(logp, entropy)``: ``(N,)`` float32, ``N = score_mask.sum()``, in row-major order
        (entropy None when not asked for); differentiable w.r.t. the model's parameters.

    Raises:
        ValueError: as :func:`output_head`, a scored column 0, or as
            :func:`~trainer.models.chunked_logprobs.chunked_token_scores`.
    """
    if score_mask.shape != input_ids.shape:
        raise ValueError(f"score_mask {tuple(score_mask.shape)} must have the shape of input_ids "
                         f"{tuple(input_ids.shape)}")
    keep = score_mask.bool()
    if bool(keep[:, 0].any()):
        raise ValueError("score_mask: column 0 cannot be scored (no position predicts it)")
    head = output_head(model)
    hidden = final_hidden_states(model, input_ids, attention_mask, position_ids, shared_prefix_tokens)[:, :-1]
    return chunked_token_scores(hidden[keep[:, 1:]], head.weight, input_ids[:, 1:][keep[:, 1:]],
                                bias=head.bias, temperature=temperature, scale=head.scale,
                                chunk_tokens=chunk_tokens, entropy=entropy, top_k=top_k, top_p=top_p)


@torch.no_grad()
def check_output_head(model: nn.Module, tokens: int = 8) -> None:
    """Check that :func:`output_head` of :func:`final_hidden_states` gives ``model(...).logits`` on a
    short input (``tokens`` ids; the model's training mode is restored).

    Raises:
        ValueError: as :func:`output_head`, or the two logits differ (beyond float rounding of the
            parameter dtype), naming the model and the difference.
    """
    head = output_head(model)
    was_training = model.training
    model.eval()
    try:
        dev = head.weight.device
        ids = (torch.arange(1, tokens + 1, device=dev) % head.weight.shape[0])[None]
        ones, pos = torch.ones_like(ids), torch.arange(tokens, device=dev)[None]
        want = model(input_ids=ids, attention_mask=ones, position_ids=pos).logits[0].float()
        hidden = final_hidden_states(model, ids, ones, pos)[0]
        got = chunk_logits(hidden, head.weight, head.bias, head.scale, 1.0)
    finally:
        model.train(was_training)
    tol = (1e-4 if head.weight.dtype == torch.float32 else 2e-2) * max(1.0, float(want.abs().max()))
    diff = float((got - want).abs().max())
    if not diff <= tol:
        raise ValueError(f"{type(model).__name__}: the output head applied to the decoder's hidden states "
                         f"does not give the model's logits (max |Δ| = {diff:.3g} > {tol:.3g}); the chunked "
                         "log-prob path cannot score this architecture")
