"""Honest intervals (issue 42 item 4.1): Wilson for proportions in ``copc eval`` and an interval
that is not zero-width at 0 % / 100 % for avg@k (trainer/evaluate/stats.py, metrics.py).

Hand values: z = 1.959964, z² = 3.8414588.
"""

from __future__ import annotations

import math

import pytest

from trainer.evaluate.metrics import summarize_benchmark
from trainer.evaluate.stats import clustered_proportion_interval, proportion_or_mean_interval, wilson_interval

Z2 = 3.8414588206941254


def _rec(q, ep, *, correct=False, answer=None, bench="aime", comps=None):
    return {"benchmark": bench, "sample_id": f"q{q}", "sample_index": q, "episode": ep, "seed": ep,
            "correct": correct, "reward": float(correct), "failed": False, "answer": answer,
            "score_components": comps or {"correct": float(correct)}, "response_tokens": 10,
            "turns": 1, "tool_calls": 0, "finish_reason": "stop"}


def _qa(q, em):
    return _rec(q, 0, correct=em == 1.0, answer="x", bench="nq",
                comps={"em": em, "substring_em": em, "f1": em, "has_answer": 1.0})


def test_zero_of_30_times_4_is_not_a_point():
    # the README's AIME row: 30 questions × 4 samples, none solved. The bootstrap gave [0, 0];
    # now the worst-case design effect (n_eff = 30 questions): [0, z²/(30 + z²)] = [0, 0.1135134]
    s = summarize_benchmark([_rec(q, e, answer="9") for q in range(30) for e in range(4)], "math")
    assert s["avg@4"] == 0.0
    assert s["avg@4_ci95"] == pytest.approx([0.0, 0.1135134], abs=1e-7)
    assert s["maj@4_ci95"] == pytest.approx([0.0, Z2 / (30 + Z2)], abs=1e-12)  # one outcome per question


def test_all_solved_gives_wilson_lower_bound():
    # 10 × 4, every sample right: [10/(10 + z²), 1] = [0.7224672, 1]
    recs = [_rec(q, e, correct=True, answer="1") for q in range(10) for e in range(4)]
    s = summarize_benchmark(recs, "math")
    assert s["avg@4_ci95"] == pytest.approx([0.7224672, 1.0], abs=1e-7)


def test_qa_k1_em_is_wilson():
    # 16 × 1, EM 0 everywhere (docs/models.md's small runs): [0, z²/(16 + z²)] = [0, 0.1936077]
    s = summarize_benchmark([_qa(q, 0.0) for q in range(16)], "qa")
    assert s["em_ci95"] == pytest.approx([0.0, 0.1936077], abs=1e-7)
    assert s["cover_em_ci95"] == pytest.approx([0.0, 0.1936077], abs=1e-7)
    # 3 of 100: centre (.03 + z²/200)/(1 + z²/100) = .0473869, half 1.887457 · .0196732 = .0371324
    s = summarize_benchmark([_qa(q, float(q < 3)) for q in range(100)], "qa")
    assert s["em_ci95"] == pytest.approx([0.0102545, 0.0845194], abs=1e-7)
    assert s["em_ci95"] == list(wilson_interval(0.03, 100))


def test_math_k1_avg_is_wilson():
    recs = [_rec(q, 0, correct=q < 3, answer="1") for q in range(100)]
    assert summarize_benchmark(recs, "math")["avg@1_ci95"] == pytest.approx([0.0102545, 0.0845194], abs=1e-7)


def test_clustered_interval_by_hand():
    # [0, .25, .5, 1] of 4 samples each: p̂ = .4375, s² = (.1914063 + .0351563 + .0039063 + .3164063)/3
    # = .1822917; n_eff = .4375 · .5625 · 4 / .1822917 = 5.4 (inside [4, 16]);
    # Wilson(.4375, 5.4): centre (.4375 + .3556906)/1.7113813 = .4634798,
    # half 1.1452532 · sqrt(.0455729 + .0329344) = .3208900 → [.1425898, .7843698]
    low_high = clustered_proportion_interval([0.0, 0.25, 0.5, 1.0], 4)
    assert low_high == pytest.approx((0.1425898, 0.7843698), abs=1e-7)
    # [.5, .75, .75, 1]: n_eff = .1875 · 4 / .0416667 = 18 > 16 samples → Wilson(.75, 16)
    assert clustered_proportion_interval([0.5, 0.75, 0.75, 1.0], 4) == wilson_interval(0.75, 16)
    # every question 2/4: s² = 0 → the independent-samples bound M = 12 → Wilson(.5, 12)
    assert clustered_proportion_interval([0.5, 0.5, 0.5], [4, 4, 4]) == wilson_interval(0.5, 12)
    # one sample per question: exactly Wilson over the questions
    assert clustered_proportion_interval([1.0, 0.0, 1.0], 1) == wilson_interval(2 / 3, 3)
    assert all(math.isnan(v) for v in clustered_proportion_interval([], 4))


def test_held_out_avg_at_k_is_not_a_point_at_zero():
    # copc train's held-out avg@2 of 5 problems, all wrong: was the normal interval [0, 0]
    assert proportion_or_mean_interval([0.0] * 5, 2) == pytest.approx((0.0, Z2 / (5 + Z2)), abs=1e-12)


@pytest.mark.parametrize(("args", "match"), [
    (([0.5, 1.5], 2), r"per_question\[1\]=1.5 must be in \[0, 1\]"),
    (([0.5, 0.5], [2]), "samples has 1 entries, per_question 2"),
    (([0.5], [0]), r"samples\[i\] must be >= 1, got 0"),
])
def test_clustered_interval_errors(args, match):
    with pytest.raises(ValueError, match=match):
        clustered_proportion_interval(*args)
