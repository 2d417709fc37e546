"""Benchmark metrics of ``copc eval``: one benchmark's records → its metric dict.

:func:`summarize_benchmark` groups the per-episode records (:mod:`trainer.evaluate.records`)
by question, leaves out infrastructure failures (counted, never scored 0), asks the benchmark
kind (:mod:`trainer.evaluate.kinds`) for the per-question values of its metrics (math: avg@n,
pass@k, maj@n; QA: EM, F1, cover-EM), and adds to each its 95 % interval (proportions: the
Wilson interval, :func:`trainer.evaluate.stats.clustered_proportion_interval`; other scores: the
percentile bootstrap, :func:`trainer.evaluate.stats.bootstrap_ci`) and the episode statistics.
Formulas and sources are in ``docs/evaluation.md``; the statistics themselves live in
:mod:`trainer.evaluate.stats` (re-exported here: ``pass_at_k``, ``maj_at_k``, ``majority_answer``,
``bootstrap_ci``, ``default_ks``).
"""

from __future__ import annotations

import math
from collections import Counter, defaultdict
from collections.abc import Mapping, Sequence
from typing import Any

from ..rollout.trajectory import split_finish
from .kinds import QA_COMPONENTS, BenchmarkKind, kind_names, make_kind
from .stats import (
    bootstrap_ci,
    check_int,
    clustered_proportion_interval,
    default_ks,
    maj_at_k,
    majority_answer,
    pass_at_k,
)

CI_SUFFIX = "_ci95"
Record = Mapping[str, Any]


def _mean(xs: Sequence[float]) -> float | None:
    return float(sum(xs) / len(xs)) if xs else None


def _number(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)


def group_by_question(records: Sequence[Record]) -> tuple[list[list[Record]], int, list[Record], int]:
    """``(groups, nominal_n, failed, questions)``: the scored records of each question with at
    least one (sorted by ``sample_index``, episode order inside), the largest number of episodes
    (failed included) of any question, the failed records, and the number of questions.

    Raises:
        ValueError: two records with the same ``(sample_index, episode)``.
    """
    by_q: dict[int, list[Record]] = defaultdict(list)
    seen: set[tuple[int, int]] = set()
    for pos, r in enumerate(records):
        qi, ep = int(r["sample_index"]), int(r.get("episode", pos))
        if (qi, ep) in seen:
            raise ValueError(f"duplicate record for sample_index={qi}, episode={ep}")
        seen.add((qi, ep))
        by_q[qi].append(r)
    groups = []
    for qi in sorted(by_q):
        scored = sorted((r for r in by_q[qi] if not r.get("failed")), key=lambda r: int(r.get("episode", 0)))
        if scored:
            groups.append(scored)
    nominal_n = max((len(v) for v in by_q.values()), default=0)
    return groups, nominal_n, [r for r in records if r.get("failed")], len(by_q)


def episode_statistics(scored: Sequence[Record], failed: Sequence[Record]) -> dict[str, Any]:
    """``mean_turns`` / ``mean_tool_calls`` / ``mean_response_tokens`` (over the scored records
    carrying the number), ``tool_call_rate`` (fraction of those with at least one tool call),
    ``answer_rate`` (fraction of scored records with an extracted ``answer``), ``finish/<reason>``
    (fraction of scored records; the part of ``finish_reason`` before ``':'``, ``unknown`` when
    absent) and ``failed/<reason>`` (counts)."""
    out: dict[str, Any] = {}
    for key in ("turns", "tool_calls", "response_tokens"):
        out[f"mean_{key}"] = _mean([float(r[key]) for r in scored if _number(r.get(key))])
    calls = [float(r["tool_calls"] > 0) for r in scored if _number(r.get("tool_calls"))]
    out["tool_call_rate"] = _mean(calls)
    out["answer_rate"] = _mean([float(r.get("answer") is not None) for r in scored])
    reasons = Counter(split_finish(str(r.get("finish_reason") or "unknown"))[0] for r in scored)
    for reason in sorted(reasons):
        out[f"finish/{reason}"] = reasons[reason] / len(scored)
    failed_reasons = Counter(split_finish(str(r.get("finish_reason") or "unknown"))[0] for r in failed)
    for reason in sorted(failed_reasons):
        out[f"failed/{reason}"] = failed_reasons[reason]
    return out


def _interval(outcomes: str | None, values: Sequence[float], groups: Sequence[Sequence[Record]],
              n_boot: int, seed: int) -> list[float]:
    """The 95 % interval of one metric's per-question ``values`` (see :func:`summarize_benchmark`)."""
    if outcomes is None:
        return list(bootstrap_ci(values, n_boot=n_boot, seed=seed))
    if outcomes not in ("episodes", "question"):
        raise ValueError(f"BenchmarkKind.outcomes gave {outcomes!r}: must be 'episodes', 'question' or None")
    samples = [len(g) for g in groups] if outcomes == "episodes" else 1
    return list(clustered_proportion_interval(values, samples))


def summarize_benchmark(records: Sequence[Record], kind: str | BenchmarkKind, ks: Sequence[int] | None = None,
                        n_boot: int = 1000, seed: int = 0) -> dict[str, Any]:
    """Metrics of one benchmark from its per-episode records.

    Records are grouped by ``sample_index`` (one question) and ordered by ``episode`` inside it.
    Records with ``failed: true`` (infrastructure failure after retries) are excluded from every
    metric and counted in ``failed_episodes`` (and by reason in ``failed/<reason>``); a question
    none of whose episodes was scored is excluded and counted in ``failed_questions``. ``n_i`` is
    the number of scored episodes of question ``i``; the nominal ``n`` (used in metric names) is
    the largest number of episodes (failed ones included) of any question.

    The kind gives the metrics (:meth:`~trainer.evaluate.kinds.BenchmarkKind.metrics`): ``math``
    ``avg@n``, ``pass@k`` for each k in ``ks`` (default: powers of two <= min_i n_i, plus
    min_i n_i; a question with ``n_i < k`` is skipped, ``pass@k_questions`` then counts those
    left, and ``pass@k`` is None when none is) and ``maj@n``; ``qa`` ``em``, ``f1``, ``cover_em``.
    Every metric ``m`` also gets a 95 % interval ``m_ci95 = [low, high]``, chosen by the kind's
    :meth:`~trainer.evaluate.kinds.BenchmarkKind.outcomes`: a proportion (avg@n, maj@n, EM,
    cover-EM) gets the Wilson score interval (Wilson 1927) —
    :func:`~trainer.evaluate.stats.clustered_proportion_interval` of the per-question values with
    ``m_i`` = the question's scored episodes (``"episodes"``) or 1 (``"question"``); with one
    sample per question exactly ``wilson_interval(p̂, questions)``, and never zero-width at 0 % or
    100 % (0 of 30 × 4: ``[0, 0.1135]``) — and any other score (pass@k, F1) the percentile
    bootstrap (:func:`bootstrap_ci` of the per-question values, ``n_boot`` resamples, ``seed``;
    the same seed for every metric).

    Always present: ``benchmark``, ``kind``, ``headline`` (the headline metric's name), ``n``
    (nominal), ``min_n`` / ``max_n`` (over scored questions), ``questions``, ``episodes``
    (scored), ``failed_episodes``, ``failed_questions``, and :func:`episode_statistics`. With no
    scored question, metrics, CIs and means are None. Values are plain Python types and the
    result is deterministic (independent of the records' order).

    Args:
        records: the per-episode records of ONE benchmark (:class:`~trainer.evaluate.records.EpisodeRecord`
            fields, as dicts).
        kind: a registered kind's name (default settings) or a :class:`BenchmarkKind`.
        ks: the ks of pass@k (math). n_boot: bootstrap resamples. seed: bootstrap seed.

    Raises:
        ValueError: an unknown ``kind``, a ``k < 1`` in ``ks``, records of more than one
            ``benchmark``, a duplicate ``(sample_index, episode)``, or a kind's own error (a
            scored QA record lacking a score component).
    """
    kind = kind if isinstance(kind, BenchmarkKind) else make_kind(kind)
    if ks is not None:
        ks = sorted({check_int("ks[]", k, 1) for k in ks})
    names = sorted({str(r["benchmark"]) for r in records if r.get("benchmark") is not None})
    if len(names) > 1:
        raise ValueError(f"records of more than one benchmark: {names}")
    groups, nominal_n, failed, questions = group_by_question(records)
    scored = [r for g in groups for r in g]
    ns = [len(g) for g in groups]
    out: dict[str, Any] = {
        "benchmark": names[0] if names else None, "kind": kind.name, "headline": kind.headline(nominal_n),
        "n": nominal_n, "min_n": min(ns) if ns else None, "max_n": max(ns) if ns else None,
        "questions": len(groups), "episodes": len(scored), "failed_episodes": len(failed),
        "failed_questions": questions - len(groups)}
    per_question, extra = kind.metrics(groups, nominal_n, ks)
    for name, values in per_question.items():
        out[name] = _mean(values)
        out[name + CI_SUFFIX] = (_interval(kind.outcomes(name), values, groups, n_boot, seed)
                                 if values else None)
        if name in extra:
            raise ValueError(f"benchmark kind {kind.name!r}: {name!r} is both a metric and an extra field")
    for name, value in extra.items():  # in the order the kind gave them, after its metrics
        out[name] = value
    out.update(episode_statistics(scored, failed))
    return out


__all__ = ["CI_SUFFIX", "QA_COMPONENTS", "bootstrap_ci", "default_ks", "episode_statistics",
           "group_by_question", "kind_names", "maj_at_k", "majority_answer", "pass_at_k",
           "summarize_benchmark"]
