"""SGLang's ``/generate`` wire format: the request body for one token-in/token-out request
(:func:`build_generate_payload`) and the checked reading of its answer
(:func:`parse_generate_response`), used by :class:`~trainer.engines.sglang.SGLangEngine`.

Log-prob semantics (SGLang >= 0.4.7, ``python/sglang/srt/layers/sampler.py``; top-p
renormalisation of returned log-probs was removed by sgl-project/sglang#5961): for a
sampled request SGLang returns ``log softmax(logits / temperature)[token]``, computed
before top-p/top-k truncation. That is the convention of :mod:`trainer.logprobs` without
truncation only: with ``top_p < 1`` or ``top_k > 1`` the learner takes log-probs over the sampler's
truncated, renormalised support, which SGLang does not report, so :func:`check_sampling` refuses
them (read from SGLang's sampler, not run here: no GPU). Two more SGLang behaviours would break the
convention and are excluded:

* ``top_k == 1`` (and temperature < 1e-6) is SGLang's greedy path, which reports
  ``log_softmax(logits)`` at temperature 1: :func:`build_generate_payload` rejects
  ``top_k=1`` with ``temperature != 1``.
* the server environment variable ``SGLANG_RETURN_ORIGINAL_LOGPROB=1`` reports
  ``log_softmax(logits)`` regardless of temperature: :mod:`.sglang_launcher` strips it.

See docs/engines.md (section "SGLang").
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from trainer.engines.base import EngineError, GenerationResult, SamplingParams, StopReason
from trainer.logprobs import truncates

#: SGLang's ``_SAMPLING_EPS`` (``srt/sampling/sampling_params.py``): a temperature below it is greedy.
SGLANG_SAMPLING_EPS = 1e-6
#: the "stop string" SGLang reports when a sampled id falls outside the vocabulary (NaN logits:
#: ``Req._check_vocab_boundary_finish`` in ``srt/managers/schedule_batch.py``).
SGLANG_NAN_MATCH = "NaN happened"


def check_sampling(params: SamplingParams) -> None:
    """Refuse top-k / top-p sampling (:func:`trainer.logprobs.truncates`): SGLang reports the
    untruncated ``log softmax(logits / T)``, not the log-probs of the truncated distribution it
    samples from, which the learner's ratios need (renormalising client-side from
    ``top_logprobs_num`` could serve ``top_k > 1``; not implemented).

    Raises:
        ValueError: ``top_p < 1`` or ``top_k > 1`` (not greedy), naming the ``rollout`` keys.
    """
    if truncates(params.top_k, params.top_p):
        raise ValueError(f"rollout.top_p={params.top_p!r} / rollout.top_k={params.top_k!r} with "
                         "rollout.engine=sglang: SGLang reports untruncated log-probs, not those of the "
                         "top-k / top-p distribution it samples from, which the learner replays; use "
                         "top_p=1 and top_k=-1, or rollout.engine=vllm / embedded")


def build_generate_payload(prompt_ids: Sequence[int], params: SamplingParams, *,
                           forward_seed: bool = False) -> dict[str, Any]:
    """JSON body of ``POST /generate`` for one token-in/token-out request.

    Args:
        prompt_ids: prompt token ids (non-empty, ints >= 0); sent as ``input_ids``
            (SGLang does not add BOS to ``input_ids``).
        params: sampling parameters; ``top_k`` 0 or -1 becomes SGLang's -1 (disabled);
            ``stop`` strings are kept in the text (``no_stop_trim``) as the stop token is
            kept in the ids.
        forward_seed: send ``params.seed`` as ``sampling_seed``.

    Returns:
        ``{"input_ids", "sampling_params", "return_logprob": True, "logprob_start_len": -1,
        "top_logprobs_num": 0, "stream": False}``.

    Raises:
        ValueError: bad ``prompt_ids``; ``top_k == 1`` with ``temperature != 1``, or a temperature
            below :data:`SGLANG_SAMPLING_EPS` (SGLang samples greedily and reports log-probs at
            temperature 1 then); top-k / top-p sampling (:func:`check_sampling`).
    """
    check_sampling(params)
    if isinstance(prompt_ids, (str, bytes)) or not len(prompt_ids):
        raise ValueError(f"prompt_ids={prompt_ids!r}: must be a non-empty sequence of token ids")
    ids = []
    for i, t in enumerate(prompt_ids):
        if isinstance(t, bool) or not isinstance(t, int) or t < 0:
            raise ValueError(f"prompt_ids[{i}]={t!r}: token ids must be ints >= 0")
        ids.append(int(t))
    if params.top_k == 1 and params.temperature != 1.0:
        raise ValueError(
            f"SamplingParams.top_k=1 with temperature={params.temperature!r}: SGLang treats top_k=1 "
            "as greedy and reports log-probs at temperature 1; use temperature=1.0 with top_k=1")
    if params.temperature < SGLANG_SAMPLING_EPS:
        raise ValueError(
            f"SamplingParams.temperature={params.temperature!r}: below SGLang's {SGLANG_SAMPLING_EPS:g} it "
            "samples greedily and reports log-probs at temperature 1; use top_k=1 with temperature=1.0")
    sampling: dict[str, Any] = {
        "temperature": float(params.temperature),
        "top_p": float(params.top_p),
        "top_k": -1 if params.top_k in (0, -1) else int(params.top_k),
        "max_new_tokens": int(params.max_new_tokens),
        "stop": list(params.stop),
        "no_stop_trim": True,
        "ignore_eos": bool(params.ignore_eos),
        "skip_special_tokens": False,
    }
    if forward_seed and params.seed is not None:
        sampling["sampling_seed"] = int(params.seed)
    return {"input_ids": ids, "sampling_params": sampling, "return_logprob": True,
            "logprob_start_len": -1, "top_logprobs_num": 0, "stream": False}


def _finish_reason(fr: object) -> tuple[StopReason, dict[str, Any]]:
    """Map SGLang's ``meta_info.finish_reason`` to ours (+ details for ``meta``).

    SGLang: ``{"type": "stop", "matched": <int token id>}`` (EOS / stop token),
    ``{"type": "stop", "matched": <str>}`` (stop string), ``{"type": "length", "length": n}``,
    ``{"type": "abort", "message": ...}``.

    Raises:
        EngineError: an unknown shape, or ``matched`` :data:`SGLANG_NAN_MATCH` (NaN logits on the server).
    """
    if not isinstance(fr, dict) or fr.get("type") not in ("stop", "length", "abort"):
        raise EngineError(f"SGLang response: meta_info.finish_reason={fr!r} is not "
                          "{'type': 'stop'|'length'|'abort', ...}")
    kind = fr["type"]
    if kind == "stop":
        matched = fr.get("matched")
        if isinstance(matched, bool) or not isinstance(matched, (int, str)):
            raise EngineError(f"SGLang response: meta_info.finish_reason={fr!r}: 'matched' must be "
                              "a token id (EOS) or a stop string")
        if matched == SGLANG_NAN_MATCH:
            raise EngineError(f"SGLang response: meta_info.finish_reason={fr!r}: the server sampled a token "
                              "outside the vocabulary (NaN logits), not a stop string")
        return ("eos" if isinstance(matched, int) else "stop"), {"matched": matched}
    if kind == "abort":
        return "abort", {"abort_message": fr.get("message")}
    return "length", {}


def parse_generate_response(body: object, version: int, *, max_new_tokens: int | None = None,
                            vocab_size: int | None = None) -> GenerationResult:
    """Turn a ``/generate`` JSON answer into a :class:`GenerationResult`.

    Token ids and log-probs come from ``meta_info.output_token_logprobs``, a list of
    ``[logprob, token_id, text_or_null]`` (one per generated token, EOS included);
    ``output_ids``, when present, must agree. Every token gets ``version``.

    Args:
        body: the decoded JSON.
        version: policy version that produced the tokens.
        max_new_tokens: if given, more tokens than this is an error.
        vocab_size: if given, a token id ``>= vocab_size`` is an error.

    Raises:
        EngineError: malformed answer (missing/ill-typed fields, non-finite or positive
            log-probs, misaligned ids, a token id outside the vocabulary, unknown finish
            reason), naming the field.
    """
    if isinstance(body, list) and len(body) == 1:
        body = body[0]
    if not isinstance(body, dict):
        raise EngineError(f"SGLang response: expected a JSON object, got {type(body).__name__}: "
                          f"{str(body)[:200]}")
    if "error" in body and "meta_info" not in body:
        raise EngineError(f"SGLang /generate error: {body['error']!r}")
    meta = body.get("meta_info")
    if not isinstance(meta, dict):
        raise EngineError(f"SGLang response: 'meta_info' missing or not an object: {str(body)[:200]}")
    entries = meta.get("output_token_logprobs")
    if not isinstance(entries, list):
        raise EngineError("SGLang response: meta_info.output_token_logprobs missing or not a list "
                          f"(was return_logprob sent?): {entries!r}"[:300])
    token_ids: list[int] = []
    logprobs: list[float] = []
    for i, e in enumerate(entries):
        if not isinstance(e, (list, tuple)) or len(e) < 2:
            raise EngineError(f"SGLang response: meta_info.output_token_logprobs[{i}]={e!r}: "
                              "expected [logprob, token_id, text]")
        lp, tok = e[0], e[1]
        if isinstance(lp, bool) or not isinstance(lp, (int, float)) or not math.isfinite(lp) or lp > 1e-6:
            raise EngineError(f"SGLang response: meta_info.output_token_logprobs[{i}][0]={lp!r}: "
                              "not a log-probability (a finite number <= 0)")
        if isinstance(tok, bool) or not isinstance(tok, int) or tok < 0:
            raise EngineError(f"SGLang response: meta_info.output_token_logprobs[{i}][1]={tok!r}: "
                              "not a token id")
        if vocab_size is not None and tok >= vocab_size:
            raise EngineError(f"SGLang response: meta_info.output_token_logprobs[{i}][1]={tok}: "
                              f"outside the tokenizer's vocabulary (size {vocab_size}); is the "
                              "server serving another model?")
        token_ids.append(tok)
        logprobs.append(min(float(lp), 0.0))
    out_ids = body.get("output_ids")
    if out_ids is not None and list(out_ids) != token_ids:
        raise EngineError(f"SGLang response: output_ids {list(out_ids)[:20]}... disagree with the ids "
                          f"in meta_info.output_token_logprobs {token_ids[:20]}...")
    if max_new_tokens is not None and len(token_ids) > max_new_tokens:
        raise EngineError(f"SGLang response: {len(token_ids)} tokens > max_new_tokens={max_new_tokens}")
    reason, details = _finish_reason(meta.get("finish_reason"))
    text = body.get("text", "")
    extra = {k: meta[k] for k in ("id", "prompt_tokens", "completion_tokens", "cached_tokens",
                                  "weight_version", "e2e_latency") if k in meta}
    return GenerationResult(token_ids=token_ids, logprobs=logprobs, versions=[version] * len(token_ids),
                            finish_reason=reason, text=text if isinstance(text, str) else "",
                            meta={**extra, **details})
