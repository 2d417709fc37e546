"""The statistics of evaluation, in one place: intervals (Wilson, normal, percentile bootstrap,
paired bootstrap) and the per-question estimators (pass@k, majority vote).

Every evaluation metric of the house — ``copc train``'s held-out evaluation
(:mod:`trainer.evaluate.heldout`) and ``copc eval``'s benchmark metrics
(:mod:`trainer.evaluate.metrics`) — takes its numbers from here. Formulas and sources:

* :func:`wilson_interval`: Wilson 1927 (JASA 22:209), the score interval of a proportion;
* :func:`normal_mean_interval`: the normal (z) interval of a mean;
* :func:`clustered_proportion_interval`: the Wilson interval of a proportion of samples drawn
  k to a question, at the design-effect (effective) sample size (Kish 1965; Korn & Graubard
  1998), never zero-width at 0 % or 100 %;
* :func:`bootstrap_ci`: the percentile bootstrap of a mean (Efron & Tibshirani 1993, ch. 13);
* :func:`paired_bootstrap`: the same over per-question differences of two evaluations;
* :func:`pass_at_k`: the unbiased estimator of Chen et al. 2021, eq. 1;
* :func:`majority_answer` / :func:`maj_at_k`: self-consistency (Wang et al. 2022).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Hashable, Mapping, Sequence
from typing import Any

import numpy as np

#: Two-sided 95 % standard normal quantile, Φ⁻¹(0.975).
Z95 = 1.959963984540054
_BOOT_CHUNK_ELEMS = 4_000_000  # resampled indices held at once by bootstrap_ci (~32 MB of int64)


def check_int(name: str, v: Any, minimum: int) -> int:
    """``v`` as an int, or ValueError naming ``name`` (bools and non-ints refused; ``v >= minimum``)."""
    if isinstance(v, bool) or not isinstance(v, int | np.integer):
        raise ValueError(f"{name} must be an int, got {v!r}")
    if v < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {v}")
    return int(v)


def wilson_interval(p_hat: float, n: float, z: float = Z95) -> tuple[float, float]:
    """Wilson score interval of a binomial proportion (Wilson 1927, JASA 22:209, eq. of the
    "probable inference" limits):

    ``(p̂ + z²/2n ± z·sqrt(p̂(1 − p̂)/n + z²/4n²)) / (1 + z²/n)``.

    Unlike the normal (Wald) interval it stays inside [0, 1] and is not degenerate at 0/n or
    n/n (0/n gives ``[0, z²/(n + z²)]``, n/n gives ``[n/(n + z²), 1]``).

    Args:
        p_hat: observed proportion of successes in [0, 1] (successes / n).
        n: number of trials (problems scored; an effective, non-integer size is allowed, see
            :func:`clustered_proportion_interval`); 0 gives ``(nan, nan)``.
        z: standard normal quantile (default :data:`Z95`, a 95 % interval).

    Returns:
        ``(low, high)`` as floats, clipped to [0, 1].

    Raises:
        ValueError: ``n < 0`` or ``p_hat`` not in [0, 1].
    """
    if n < 0:
        raise ValueError(f"wilson_interval: n={n!r} must be >= 0")
    if n == 0:
        return float("nan"), float("nan")
    if not 0.0 <= p_hat <= 1.0:
        raise ValueError(f"wilson_interval: p_hat={p_hat!r} must be in [0, 1]")
    z2 = z * z
    denom = 1.0 + z2 / n
    center = (p_hat + z2 / (2 * n)) / denom
    half = z / denom * math.sqrt(p_hat * (1.0 - p_hat) / n + z2 / (4 * n * n))
    # the bound at 0 / n is exactly 0 / 1 (center - half cancels only up to rounding: ~3e-18)
    low = 0.0 if p_hat == 0.0 else max(0.0, center - half)
    return low, 1.0 if p_hat == 1.0 else min(1.0, center + half)


def normal_mean_interval(values: Sequence[float], z: float = Z95) -> tuple[float, float]:
    """Normal-approximation (z, not Student t) interval of the mean of per-problem scores in
    [0, 1]: ``mean ± z · s / sqrt(n)`` with ``s`` the sample standard deviation (ddof = 1),
    clipped to [0, 1]. Used for avg@k with k > 1, whose per-problem values are not 0/1.

    With n < 30 problems the z quantile makes the interval slightly too narrow (the t
    quantile would be wider); when every problem has the same score ``s = 0`` and the interval
    collapses to a point.

    Args:
        values: per-problem scores (e.g. each problem's fraction of correct copies).
        z: standard normal quantile (default :data:`Z95`).

    Returns:
        ``(low, high)`` floats; ``(nan, nan)`` with fewer than 2 values.
    """
    n = len(values)
    if n < 2:
        return float("nan"), float("nan")
    arr = np.asarray(values, dtype=np.float64)
    mean, half = float(arr.mean()), z * float(arr.std(ddof=1)) / math.sqrt(n)
    return max(0.0, mean - half), min(1.0, mean + half)


def clustered_proportion_interval(per_question: Sequence[float], samples: Sequence[int] | int = 1,
                                  z: float = Z95) -> tuple[float, float]:
    """Wilson interval of a proportion whose 0/1 outcomes come ``m_i`` to a question (avg@k).

    ``per_question[i] = c_i / m_i`` is the fraction of question ``i``'s ``m_i = samples[i]``
    outcomes that are 1; the estimate is ``p̂ = mean_i per_question[i]`` (avg@k). Outcomes of one
    question are correlated (easy and hard questions), so the ``M = Σ m_i`` outcomes are worth
    fewer independent trials: the interval is :func:`wilson_interval` of ``p̂`` at the effective
    sample size (Kish 1965, *Survey Sampling*, design effect; Korn & Graubard 1998, Survey
    Methodology 24:193, the effective-size binomial interval; Dean & Pagano 2015, J. Survey Stat.
    Methodol. 3:484, its Wilson form for cluster samples)::

        n_eff = p̂ (1 − p̂) / (s² / n),   clipped to [n, M]

    with ``n`` questions and ``s²`` the sample variance (ddof = 1) of ``per_question``. The
    bounds: ``n`` is the worst case (every question's outcomes equal, design effect ``M / n``),
    ``M`` the best (independent outcomes). Where ``s²`` says nothing about the correlation the
    choice is fixed: ``p̂`` of 0 or 1 (every outcome equal) takes the worst case ``n`` — so
    0 of 30 × 4 gives ``[0, z²/(30 + z²)] = [0, 0.1135]``, the interval of 30 single-sample
    questions, not a point; ``s² = 0`` with ``0 < p̂ < 1`` (every question the same fraction)
    takes ``M``; a single question takes ``n = 1``. With one outcome per question
    (``m_i = 1``) this is exactly ``wilson_interval(p̂, n)``; inside (0, 1) with ``n_eff`` in
    range it is close to the normal interval ``p̂ ± z·s/√n``.

    Args:
        per_question: each question's fraction of 1-outcomes, in [0, 1] (float list, length n).
        samples: ``m_i`` per question (ints >= 1, length n), or one int for every question.
        z: standard normal quantile (default :data:`Z95`).

    Returns:
        ``(low, high)`` floats in [0, 1]; ``(nan, nan)`` with no question.

    Raises:
        ValueError: naming the argument: a value outside [0, 1], ``samples`` of another length,
            or an ``m_i < 1``.
    """
    n = len(per_question)
    ms = [samples] * n if isinstance(samples, int | np.integer) else list(samples)
    if len(ms) != n:
        raise ValueError(f"clustered_proportion_interval: samples has {len(ms)} entries, per_question {n}")
    for m in ms:
        check_int("clustered_proportion_interval: samples[i]", m, 1)
    if n == 0:
        return float("nan"), float("nan")
    arr = np.asarray(per_question, dtype=np.float64)
    bad = np.flatnonzero(~((arr >= 0.0) & (arr <= 1.0)))
    if bad.size:
        i = int(bad[0])
        raise ValueError(f"clustered_proportion_interval: per_question[{i}]={float(arr[i])!r} "
                         "must be in [0, 1]")
    p_hat, total = float(sum(per_question)) / n, int(sum(ms))
    if total == n or n == 1 or p_hat in (0.0, 1.0):
        return wilson_interval(p_hat, n, z)
    var = float(arr.var(ddof=1))
    n_eff = float(total) if var == 0.0 else min(float(total), max(float(n), p_hat * (1.0 - p_hat) * n / var))
    return wilson_interval(p_hat, n_eff, z)


def proportion_or_mean_interval(per_problem: Sequence[float], k: int) -> tuple[float, float]:
    """The 95 % interval of a held-out score over problems, each the fraction of its ``k``
    episodes solved: :func:`clustered_proportion_interval` with ``k`` samples a problem — with
    ``k == 1`` the Wilson interval of the proportion (:func:`wilson_interval`), with ``k > 1`` the
    Wilson interval at the effective sample size (close to the normal interval of the mean of
    the per-problem scores inside (0, 1), and not zero-width at 0 % or 100 %)."""
    return clustered_proportion_interval(per_problem, k)


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
    n_boot = check_int("n_boot", n_boot, 1)
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


def paired_bootstrap(before: Mapping[Hashable, float], after: Mapping[Hashable, float], *,
                     n_boot: int = 10000, seed: int = 0) -> dict[str, Any]:
    """Paired change ``after − before`` of a per-question score, with its 95 % percentile
    bootstrap interval (:func:`bootstrap_ci` of the per-question differences, questions
    resampled; Efron & Tibshirani 1993, ch. 13). Pairing removes the between-question variance
    that two separate intervals would double count.

    Only questions in both mappings count; they are taken in sorted key order, so the result
    is deterministic for a ``seed``.

    Args:
        before / after: question key → score (e.g. the mean EM over its episodes).
        n_boot: bootstrap resamples (>= 1).
        seed: seed of the numpy generator.

    Returns:
        ``{"mean": mean difference, "ci95_low", "ci95_high", "n": questions paired}``; the
        mean and bounds are NaN when no question is in both.

    Raises:
        ValueError: ``n_boot < 1`` (the message names ``n_boot``).
    """
    if isinstance(n_boot, bool) or not isinstance(n_boot, int) or n_boot < 1:
        raise ValueError(f"paired_difference: n_boot={n_boot!r} must be an int >= 1")
    common = sorted(set(before) & set(after))
    if not common:
        nan = float("nan")
        return {"mean": nan, "ci95_low": nan, "ci95_high": nan, "n": 0}
    diffs = np.array([after[q] - before[q] for q in common], dtype=np.float64)
    low, high = bootstrap_ci(diffs, n_boot=n_boot, seed=seed)
    return {"mean": float(diffs.mean()), "ci95_low": low, "ci95_high": high, "n": len(common)}


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
    n = check_int("n", n, 1)
    c = check_int("c", c, 0)
    k = check_int("k", k, 1)
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


def default_ks(min_n: int) -> list[int]:
    """The default ks of pass@k: the powers of two <= ``min_n``, plus ``min_n`` itself (sorted)."""
    ks, k = [], 1
    while k <= min_n:
        ks.append(k)
        k *= 2
    if min_n >= 1 and min_n not in ks:
        ks.append(min_n)
    return ks


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
        1.0 or 0.0 (averaged over questions by the benchmark summary).

    Raises:
        ValueError: if the sequences differ in length, are empty, or ``k`` is out of range.
    """
    if len(answers) != len(correct):
        raise ValueError(f"answers and correct differ in length: {len(answers)} != {len(correct)}")
    if not answers:
        raise ValueError("answers must not be empty")
    k = len(answers) if k is None else check_int("k", k, 1)
    if k > len(answers):
        raise ValueError(f"k must be <= the number of samples, got k={k} > {len(answers)}")
    answers, correct = list(answers[:k]), list(correct[:k])
    winner = majority_answer(answers)
    if winner is None:
        return 0.0
    return float(bool(correct[answers.index(winner)]))


__all__ = ["Z95", "bootstrap_ci", "check_int", "clustered_proportion_interval", "default_ks", "maj_at_k",
           "majority_answer", "normal_mean_interval", "paired_bootstrap", "pass_at_k",
           "proportion_or_mean_interval", "wilson_interval"]
