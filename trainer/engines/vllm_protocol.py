"""vLLM's ``/v1/completions`` wire format for one token-in/token-out request
(:func:`build_completion_payload`) and the checked reading of its answer
(:func:`parse_completion_response`), used by :class:`~trainer.engines.vllm.VLLMEngine`.

Log-prob semantics (vLLM 0.32, measured in /work/shared/docs/vllm_cpu.md and by the ``vllm`` tests): a
server started with ``--logprobs-mode processed_logprobs`` reports the log-probs of the distribution it
samples from, after temperature *and* top-k / top-p. Without top-k / top-p that is
``log softmax(logits / T)[token]``; with them it is renormalised over the kept tokens. Both are the
convention of :mod:`trainer.logprobs`, whose learner side replays the same top-k / top-p support
(:func:`trainer.logprobs.support_logits`, the set vLLM's ``apply_top_k_top_p`` keeps up to ties and
rounding), so ``top_p`` and ``top_k`` are sent as asked.

Greedy decoding (``top_k = 1`` at temperature 1, how evaluation encodes ``temperature = 0``: see
:func:`trainer.evaluate.runner.eval_sampling_params`) is sent as ``temperature: 0``, vLLM's greedy:
the arg-max token, and its processed log-probs are ``log softmax(logits)`` (vLLM 0.32's sampler takes
a greedy request's temperature as 1 and applies no top-k / top-p to it, alone or in a mixed batch),
the log-probs the embedded engine reports for the same request. Greedy at another temperature is
refused (vLLM would report them at temperature 1).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from .base import EngineError, GenerationResult, SamplingParams, StopReason


def check_sampling(params: SamplingParams) -> None:
    """Refuse sampling settings under which vLLM's log-probs are not :mod:`trainer.logprobs`'s.

    Greedy (``top_k == 1``) is accepted at temperature 1 only (:func:`is_greedy`); top-k / top-p
    sampling is accepted (vLLM's processed log-probs are the truncated ones the learner replays).

    Raises:
        ValueError: ``top_k == 1`` at a temperature other than 1, naming the ``rollout`` key and value.
    """
    if params.top_k == 1 and params.temperature != 1.0:
        raise ValueError(f"rollout.top_k=1 (greedy) with rollout.temperature={params.temperature!r} and "
                         "rollout.engine=vllm: vLLM's greedy decoding reports log-probs at temperature 1, "
                         "not log softmax(logits / T); use temperature=1 or top_k=-1")


def is_greedy(params: SamplingParams) -> bool:
    """Whether ``params`` asks for greedy decoding (``top_k == 1``), sent to vLLM as ``temperature: 0``."""
    return params.top_k == 1


def build_completion_payload(prompt_ids: Sequence[int], params: SamplingParams, model: str) -> dict[str, Any]:
    """JSON body of ``POST /v1/completions`` for one token-in/token-out request.

    Args:
        prompt_ids: prompt token ids (non-empty, ints >= 0), sent as ``prompt`` (no BOS is added).
        params: sampling parameters (checked by :func:`check_sampling`; greedy is sent as
            ``temperature`` 0); stop strings are kept in the text (``include_stop_str_in_output``) as
            the completing token is kept in the ids.
        model: the served base model's name or a loaded LoRA adapter's name.

    Returns:
        The body: ``prompt`` (ids), ``max_tokens``, ``temperature``, ``top_p`` and ``top_k`` (1 and
        -1 for greedy or when off), ``logprobs`` 0 (the sampled token's),
        ``return_tokens_as_token_ids``, ``return_token_ids``, ``stop``, ``include_stop_str_in_output``,
        ``ignore_eos``, ``skip_special_tokens`` false,
        ``seed`` when given.

    Raises:
        ValueError: bad ``prompt_ids`` or refused sampling settings.
    """
    check_sampling(params)
    if isinstance(prompt_ids, (str, bytes)) or not len(prompt_ids):
        raise ValueError(f"prompt_ids={prompt_ids!r}: must be a non-empty sequence of token ids")
    ids = []
    for i, t in enumerate(prompt_ids):
        if isinstance(t, bool) or not isinstance(t, int) or t < 0:
            raise ValueError(f"prompt_ids[{i}]={t!r}: token ids must be ints >= 0")
        ids.append(int(t))
    greedy = is_greedy(params)
    body: dict[str, Any] = {
        "model": model, "prompt": ids, "max_tokens": int(params.max_new_tokens),
        "temperature": 0.0 if greedy else float(params.temperature),
        "top_p": 1.0 if greedy else float(params.top_p),
        "top_k": -1 if greedy or params.top_k <= 0 else int(params.top_k), "logprobs": 0,
        "return_tokens_as_token_ids": True, "return_token_ids": True, "stop": list(params.stop),
        "include_stop_str_in_output": True, "ignore_eos": bool(params.ignore_eos),
        "skip_special_tokens": False, "stream": False}
    if params.seed is not None:
        body["seed"] = int(params.seed)
    return body


def _finish_reason(choice: dict) -> tuple[StopReason, dict[str, Any]]:
    """Map vLLM's ``finish_reason`` / ``stop_reason`` to ours: ``stop`` with a string stop reason is a
    stop string, ``stop`` without (or with a stop token id) is EOS; ``length``; ``abort``."""
    fr, sr = choice.get("finish_reason"), choice.get("stop_reason")
    if fr == "length":
        return "length", {}
    if fr == "abort":
        return "abort", {}
    if fr == "stop":
        return ("stop", {"matched": sr}) if isinstance(sr, str) else ("eos", {"matched": sr})
    raise EngineError(f"vLLM response: choices[0].finish_reason={fr!r} is not 'stop', 'length' or 'abort'")


def parse_completion_response(body: object, version: int, *, max_new_tokens: int | None = None,
                              vocab_size: int | None = None) -> GenerationResult:
    """Turn a ``/v1/completions`` JSON answer into a :class:`GenerationResult`.

    Token ids are ``choices[0].token_ids``; they must equal the ids in ``logprobs.tokens``
    (``token_id:N``); log-probs are ``logprobs.token_logprobs``. Every token gets ``version``.

    Raises:
        EngineError: malformed answer (missing fields, non-finite or positive log-probs, misaligned
            ids, an id outside the vocabulary, an unknown finish reason), naming the field.
    """
    if not isinstance(body, dict) or not isinstance(body.get("choices"), list) or len(body["choices"]) != 1:
        raise EngineError(f"vLLM response: expected an object with one choice, got {str(body)[:300]}")
    choice = body["choices"][0]
    ids, lp = choice.get("token_ids"), (choice.get("logprobs") or {})
    lps, toks = lp.get("token_logprobs"), lp.get("tokens")
    if not isinstance(ids, list) or not isinstance(lps, list) or not isinstance(toks, list):
        raise EngineError("vLLM response: choices[0].token_ids / logprobs.token_logprobs / logprobs.tokens "
                          f"missing (was logprobs=0 and return_token_ids sent?): {str(choice)[:300]}")
    if not len(ids) == len(lps) == len(toks):
        raise EngineError(f"vLLM response: {len(ids)} token_ids, {len(lps)} token_logprobs, "
                          f"{len(toks)} tokens")
    logprobs: list[float] = []
    for i, (t, x, s) in enumerate(zip(ids, lps, toks, strict=True)):
        if isinstance(t, bool) or not isinstance(t, int) or t < 0 or s != f"token_id:{t}":
            raise EngineError(f"vLLM response: token {i}: id {t!r} and logprobs.tokens[{i}]={s!r} disagree")
        if vocab_size is not None and t >= vocab_size:
            raise EngineError(f"vLLM response: token id {t} outside the tokenizer's vocabulary (size "
                              f"{vocab_size}); is the server serving another model?")
        if isinstance(x, bool) or not isinstance(x, (int, float)) or not math.isfinite(x) or x > 1e-6:
            raise EngineError(f"vLLM response: logprobs.token_logprobs[{i}]={x!r} is not a log-probability")
        logprobs.append(min(float(x), 0.0))
    if max_new_tokens is not None and len(ids) > max_new_tokens:
        raise EngineError(f"vLLM response: {len(ids)} tokens > max_new_tokens={max_new_tokens}")
    reason, details = _finish_reason(choice)
    text = choice.get("text")
    return GenerationResult(token_ids=list(ids), logprobs=logprobs, versions=[version] * len(ids),
                            finish_reason=reason, text=text if isinstance(text, str) else "",
                            meta={"id": body.get("id"), **details})
