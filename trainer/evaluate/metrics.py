"""Benchmark metrics for standalone evaluation (``copc eval``): pass@k, avg@k, maj@k, EM / F1 / cover-EM.

The runner writes one record per episode (one line of ``results.jsonl``);
:func:`summarize_benchmark` turns the records of one benchmark into the metric dict that
:func:`trainer.evaluate.report.write_report` renders. Formulas and sources are in
``docs/evaluation.md``:

* ``pass@k``: the unbiased estimator of Chen et al. 2021 ("Evaluating Large Language Models
  Trained on Code", eq. 1), ``1 - C(n - c, k) / C(n, k)`` per question, averaged over questions.
* ``avg@n``: mean accuracy over the ``n`` samples of a question, averaged over questions
  (as reported for AIME in DeepSeek-R1).
* ``maj@n``: accuracy of the most common extracted answer (self-consistency, Wang et al. 2022).
* ``em`` / ``f1`` / ``cover_em``: the QA environment's SQuAD-normalised exact match, token F1 and
  substring ("cover") exact match, averaged per question then over questions.
* ``<metric>_ci95``: percentile bootstrap over questions (:func:`bootstrap_ci`).

Infrastructure failures (records with ``failed: true``) are excluded from every metric and
counted (``failed_episodes``, ``failed_questions``); they are never scored 0.
"""

from __future__ import annotations

import math
from collections import Counter, defaultdict
from collections.abc import Hashable, Mapping, Sequence
from typing import Any

import numpy as np

KINDS = ("math", "qa")
# QA metric name -> the environment's score component it averages.
QA_COMPONENTS = {"em": "em", "f1": "f1", "cover_em": "substring_em"}
CI_SUFFIX = "_ci95"
_BOOT_CHUNK_ELEMS = 4_000_000  # resampled indices held at once by bootstrap_ci (~32 MB of int64)


def _check_int(name: str, v: Any, minimum: int) -> int:
    if isinstance(v, bool) or not isinstance(v, int | np.integer):
        raise ValueError(f"{name} must be an int, got {v!r}")
    if v < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {v}")
    return int(v)


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of one question: the chance that ``k`` of its ``n`` samples include a correct one.

    Formula (Chen et al. 2021, "Evaluating Large Language Models Trained on Code", eq. 1)::

        pass@k = 1 - C(n - c, k) / C(n, k)
               = 1 - prod_{i = n - c + 1}^{n} (1 - k / i)      (numerically stable form)

    and 1 when ``n - c < k`` (every ``k``-subset contains a correct sample).

    Args:
        n: samples drawn for the question (>= 1).
        c: correct samples among them (0 <= c <= n).
        k: the k of pass@k (1 <= k <= n).

    Returns:
        pass@k in [0, 1]; ``c = 0`` gives 0, ``c = n`` gives 1, ``k = 1`` gives ``c / n``.

    Raises:
        ValueError: naming the argument, if one is not an int, is negative, ``k < 1``,
            ``c > n`` or ``k > n``.
    """
    n = _check_int("n", n, 1)
    c = _check_int("c", c, 0)
    k = _check_int("k", k, 1)
    if c > n:
        raise ValueError(f"c must be <= n, got c={c} > n={n}")
    if k > n:
        raise ValueError(f"k must be <= n, got k={k} > n={n}")
    if n - c < k:
        return 1.0
    prod = 1.0
    for i in range(n - c + 1, n + 1):
        prod *= 1.0 - k / i
    return float(1.0 - prod)


def majority_answer(answers: Sequence[Hashable | None]) -> Hashable | None:
    """The most common answer among a question's samples (self-consistency vote, Wang et al. 2022).

    Answers are compared exactly as given (the runner stores the environment's extracted final
    answer; no further normalisation here). ``None`` (no answer extracted) casts no vote.

    Ties are broken deterministically: among the answers with the highest count, the one that
    occurs first in ``answers`` wins (the runner orders a question's samples by episode index).

    Args:
        answers: the extracted answers of one question's samples, in episode order.

    Returns:
        The winning answer, or ``None`` when no sample has an answer.
    """
    counts = Counter(a for a in answers if a is not None)
    if not counts:
        return None
    best = max(counts.values())
    return next(a for a in answers if a is not None and counts[a] == best)


def maj_at_k(answers: Sequence[Hashable | None], correct: Sequence[bool], k: int | None = None) -> float:
    """maj@k of one question: 1.0 if the majority answer of its first ``k`` samples is correct, else 0.0.

    The majority answer is :func:`majority_answer` of ``answers[:k]`` (ties: first occurrence).
    Its gold-correctness is the ``correct`` flag of the first sample (within the first ``k``) that
    gave that answer; graders are deterministic, so every sample with the same answer agrees.
    No answer extracted from any sample scores 0.

    Args:
        answers: extracted answers, in episode order (``None`` = none extracted).
        correct: per-sample correctness, aligned with ``answers``.
        k: samples to vote over (default: all of them); 1 <= k <= len(answers).

    Returns:
        1.0 or 0.0 (averaged over questions by :func:`summarize_benchmark`).

    Raises:
        ValueError: if the sequences differ in length, are empty, or ``k`` is out of range.
    """
    if len(answers) != len(correct):
        raise ValueError(f"answers and correct differ in length: {len(answers)} != {len(correct)}")
    if not answers:
        raise ValueError("answers must not be empty")
    k = len(answers) if k is None else _check_int("k", k, 1)
    if k > len(answers):
        raise ValueError(f"k must be <= the number of samples, got k={k} > {len(answers)}")
    answers, correct = list(answers[:k]), list(correct[:k])
    winner = majority_answer(answers)
    if winner is None:
        return 0.0
    return float(bool(correct[answers.index(winner)]))


def bootstrap_ci(values: Sequence[float], *, n_boot: int = 1000, seed: int = 0,
                 level: float = 0.95) -> tuple[float, float]:
    """Percentile bootstrap confidence interval of the mean of ``values`` (one value per question).

    Draws ``n_boot`` resamples of the questions with replacement (``numpy.random.default_rng(seed)``),
    takes each resample's mean, and returns the ``(1 - level) / 2`` and ``(1 + level) / 2``
    quantiles of those means (Efron & Tibshirani 1993, percentile method). Deterministic for a
    given ``seed``; memory is bounded by drawing the resamples in chunks.

    Args:
        values: per-question scores (finite floats), e.g. each question's accuracy.
        n_boot: bootstrap resamples (>= 1).
        seed: seed of the numpy Generator.
        level: coverage of the interval, in (0, 1).

    Returns:
        ``(low, high)`` as Python floats; a single value ``v`` gives ``(v, v)``.

    Raises:
        ValueError: if ``values`` is empty or not finite, ``n_boot < 1`` or ``level`` not in (0, 1).
    """
    arr = np.asarray(values, dtype=np.float64).reshape(-1)
    if arr.size == 0:
        raise ValueError("values must not be empty")
    if not np.all(np.isfinite(arr)):
        raise ValueError("values must be finite")
    n_boot = _check_int("n_boot", n_boot, 1)
    if not 0.0 < float(level) < 1.0:
        raise ValueError(f"level must be in (0, 1), got {level}")
    rng = np.random.default_rng(seed)
    n = arr.size
    rows = max(1, _BOOT_CHUNK_ELEMS // n)
    means = np.empty(n_boot, dtype=np.float64)
    for start in range(0, n_boot, rows):
        stop = min(n_boot, start + rows)
        idx = rng.integers(0, n, size=(stop - start, n))
        means[start:stop] = arr[idx].mean(axis=1)
    alpha = (1.0 - float(level)) / 2.0
    low, high = np.quantile(means, [alpha, 1.0 - alpha])
    return float(low), float(high)


def default_ks(min_n: int) -> list[int]:
    """The default ks of pass@k: the powers of two <= ``min_n``, plus ``min_n`` itself (sorted)."""
    ks, k = [], 1
    while k <= min_n:
        ks.append(k)
        k *= 2
    if min_n >= 1 and min_n not in ks:
        ks.append(min_n)
    return ks


def _mean(xs: Sequence[float]) -> float | None:
    return float(sum(xs) / len(xs)) if xs else None


def _number(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)


def summarize_benchmark(records: Sequence[Mapping[str, Any]], kind: str, ks: Sequence[int] | None = None,
                        n_boot: int = 1000, seed: int = 0) -> dict[str, Any]:
    """Metrics of one benchmark from its per-episode records.

    Records are grouped by ``sample_index`` (one question) and ordered by ``episode`` inside it.
    Records with ``failed: true`` (infrastructure failure after retries) are excluded from every
    metric and counted in ``failed_episodes`` (and by reason in ``failed/<reason>``); a question
    none of whose episodes was scored is excluded and counted in ``failed_questions``. ``n_i`` is
    the number of scored episodes of question ``i``; the nominal ``n`` (used in metric names) is
    the largest number of episodes (failed ones included) of any question.

    Metrics for ``kind="math"`` (``correct`` = reward > 0.5, set by the runner)::

        avg@n  = mean_i c_i / n_i                       (mean accuracy over the n samples)
        pass@k = mean_{i: n_i >= k} pass_at_k(n_i, c_i, k)   for each k in ks
        maj@n  = mean_i maj_at_k(answers_i, correct_i)    (all n_i scored samples vote)

    A question with ``n_i < k`` is skipped for pass@k (its estimator is undefined); when any is
    skipped, ``pass@k_questions`` gives how many questions entered the mean, and when none is
    left ``pass@k`` is ``None``. Default ``ks``: powers of two <= min_i n_i, plus min_i n_i.

    Metrics for ``kind="qa"``: ``em``, ``f1`` and ``cover_em`` are, per question, the mean over
    its scored episodes of the ``score_components`` ``em``, ``f1`` and ``substring_em`` (``em``
    falls back to ``correct`` when the component is absent), then the mean over questions.

    Every headline metric ``m`` also gets ``m_ci95 = [low, high]`` (:func:`bootstrap_ci` of the
    per-question values, 95 %, ``n_boot`` resamples, ``seed``; the same seed for every metric,
    so the intervals are paired over the same resamples).

    Always present: ``benchmark``, ``kind``, ``headline`` (the name of the headline metric:
    ``avg@n`` or ``em``), ``n`` (nominal), ``min_n`` / ``max_n`` (over scored questions),
    ``questions`` (scored questions), ``episodes`` (scored episodes), ``failed_episodes``,
    ``failed_questions``, ``mean_turns``, ``mean_tool_calls``, ``mean_response_tokens`` (means
    over scored episodes that carry the number), ``finish/<reason>`` (fraction of scored episodes;
    the reason is the part of ``finish_reason`` before ``':'``, ``unknown`` when absent). With no
    scored question, metrics, CIs and means are ``None``. All values are plain Python types
    (JSON-serialisable) and the result is deterministic.

    Args:
        records: the per-episode records of ONE benchmark (keys as written by the runner:
            ``sample_index``, ``episode``, ``failed``, ``correct``, ``answer``,
            ``score_components``, ``turns``, ``tool_calls``, ``response_tokens``, ``finish_reason``).
        kind: ``"math"`` or ``"qa"``.
        ks: the ks of pass@k (math only); default as above.
        n_boot: bootstrap resamples for the CIs.
        seed: bootstrap seed.

    Returns:
        The metric dict described above.

    Raises:
        ValueError: for an unknown ``kind``, a ``k < 1`` in ``ks``, records of more than one
            ``benchmark``, two records with the same ``(sample_index, episode)``, or a scored QA
            record lacking the ``f1`` or ``substring_em`` component.
    """
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    if ks is not None:
        ks = sorted({_check_int("ks[]", k, 1) for k in ks})
    names = sorted({str(r["benchmark"]) for r in records if r.get("benchmark") is not None})
    if len(names) > 1:
        raise ValueError(f"records of more than one benchmark: {names}")

    by_q: dict[int, list[Mapping[str, Any]]] = defaultdict(list)
    seen: set[tuple[int, int]] = set()
    for pos, r in enumerate(records):
        qi, ep = int(r["sample_index"]), int(r.get("episode", pos))
        if (qi, ep) in seen:
            raise ValueError(f"duplicate record for sample_index={qi}, episode={ep}")
        seen.add((qi, ep))
        by_q[qi].append(r)
    nominal_n = max((len(v) for v in by_q.values()), default=0)
    failed = [r for r in records if r.get("failed")]
    groups: list[list[Mapping[str, Any]]] = []
    for qi in sorted(by_q):
        scored = sorted((r for r in by_q[qi] if not r.get("failed")), key=lambda r: int(r.get("episode", 0)))
        if scored:
            groups.append(scored)
    scored_all = [r for g in groups for r in g]
    ns = [len(g) for g in groups]

    out: dict[str, Any] = {
        "benchmark": names[0] if names else None,
        "kind": kind,
        "headline": f"avg@{nominal_n}" if kind == "math" else "em",
        "n": nominal_n,
        "min_n": min(ns) if ns else None,
        "max_n": max(ns) if ns else None,
        "questions": len(groups),
        "episodes": len(scored_all),
        "failed_episodes": len(failed),
        "failed_questions": len(by_q) - len(groups),
    }

    def put(name: str, per_question: Sequence[float]) -> None:
        if per_question:
            out[name] = _mean(per_question)
            out[name + CI_SUFFIX] = list(bootstrap_ci(per_question, n_boot=n_boot, seed=seed))
        else:
            out[name] = None
            out[name + CI_SUFFIX] = None

    if kind == "math":
        correct = [[bool(r.get("correct")) for r in g] for g in groups]
        put(f"avg@{nominal_n}", [sum(c) / len(c) for c in correct])
        for k in ks if ks is not None else default_ks(min(ns) if ns else 0):
            vals = [pass_at_k(len(c), sum(c), k) for c in correct if len(c) >= k]
            put(f"pass@{k}", vals)
            if len(vals) < len(correct):
                out[f"pass@{k}_questions"] = len(vals)
        put(f"maj@{nominal_n}",
            [maj_at_k([r.get("answer") for r in g], c) for g, c in zip(groups, correct, strict=True)])
    else:
        per_metric: dict[str, list[float]] = {m: [] for m in QA_COMPONENTS}
        for g in groups:
            for metric, comp in QA_COMPONENTS.items():
                vals = []
                for r in g:
                    v = (r.get("score_components") or {}).get(comp)
                    if v is None and metric == "em":
                        v = bool(r.get("correct"))
                    if v is None:
                        raise ValueError(f"scored QA record (sample_index={r['sample_index']}, "
                                         f"episode={r.get('episode')}) lacks score component {comp!r}")
                    vals.append(float(v))
                per_metric[metric].append(sum(vals) / len(vals))
        for metric, vals in per_metric.items():
            put(metric, vals)

    for key in ("turns", "tool_calls", "response_tokens"):
        out[f"mean_{key}"] = _mean([float(r[key]) for r in scored_all if _number(r.get(key))])
    reasons = Counter(str(r.get("finish_reason") or "unknown").split(":")[0] for r in scored_all)
    for reason in sorted(reasons):
        out[f"finish/{reason}"] = reasons[reason] / len(scored_all)
    failed_reasons = Counter(str(r.get("finish_reason") or "unknown").split(":")[0] for r in failed)
    for reason in sorted(failed_reasons):
        out[f"failed/{reason}"] = failed_reasons[reason]
    return out
