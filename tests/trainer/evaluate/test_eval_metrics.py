"""Metrics and report of standalone evaluation (trainer/evaluate/metrics.py, report.py)."""

from __future__ import annotations

import itertools
import json
import random
from math import comb

import pytest

from trainer.evaluate.metrics import (
    bootstrap_ci,
    default_ks,
    maj_at_k,
    majority_answer,
    pass_at_k,
    summarize_benchmark,
)
from trainer.evaluate.report import format_metric, write_report

# ---------------------------------------------------------------- pass@k


@pytest.mark.parametrize(("k", "expected"), [(1, 0.4), (2, 0.7), (5, 1.0)])
def test_pass_at_k_hand_values(k, expected):
    # n=5, c=2: pass@2 = 1 - C(3,2)/C(5,2) = 1 - 3/10.
    assert pass_at_k(5, 2, k) == pytest.approx(expected)


def test_pass_at_k_extremes():
    for n in range(1, 9):
        for k in range(1, n + 1):
            assert pass_at_k(n, 0, k) == 0.0
            assert pass_at_k(n, n, k) == 1.0
        for c in range(n + 1):
            assert pass_at_k(n, c, 1) == pytest.approx(c / n)


def _slow_pass_at_k(n: int, c: int, k: int) -> float:
    """Fraction of k-subsets of n samples (the first c correct) that contain a correct sample."""
    subsets = list(itertools.combinations(range(n), k))
    return sum(any(i < c for i in s) for s in subsets) / len(subsets)


def test_pass_at_k_matches_subset_enumeration():
    rng = random.Random(0)
    for _ in range(200):
        n = rng.randint(1, 10)
        c, k = rng.randint(0, n), rng.randint(1, n)
        assert pass_at_k(n, c, k) == pytest.approx(_slow_pass_at_k(n, c, k), abs=1e-12)
        assert pass_at_k(n, c, k) == pytest.approx(1 - comb(n - c, k) / comb(n, k), abs=1e-12)


def test_pass_at_k_large_n_is_stable():
    assert 0.0 <= pass_at_k(1000, 3, 500) <= 1.0
    assert pass_at_k(1000, 3, 500) == pytest.approx(1 - comb(997, 500) / comb(1000, 500))


@pytest.mark.parametrize(("args", "name"), [
    ((5, 2, 6), "k"), ((5, 6, 1), "c"), ((-1, 0, 1), "n"), ((5, -1, 1), "c"),
    ((5, 2, -1), "k"), ((5, 2, 0), "k"), ((5.0, 2, 1), "n"), ((5, True, 1), "c"),
])
def test_pass_at_k_errors_name_the_argument(args, name):
    with pytest.raises(ValueError, match=rf"^{name} "):
        pass_at_k(*args)


# ---------------------------------------------------------------- maj@k


def test_majority_answer_ties_and_none():
    assert majority_answer(["3", "5", "5", "3", None]) == "3"  # tie: first occurrence wins
    assert majority_answer([None, "7", None, "8", "8"]) == "8"  # None casts no vote
    assert majority_answer([None, None]) is None
    assert majority_answer([]) is None


def test_maj_at_k():
    answers = ["1", "2", "2", "1", "1"]
    correct = [True, False, False, True, True]
    assert maj_at_k(answers, correct) == 1.0
    assert maj_at_k(answers, correct, k=3) == 0.0  # "2" wins among the first three
    assert maj_at_k([None, None], [False, False]) == 0.0
    with pytest.raises(ValueError, match="k must be <="):
        maj_at_k(answers, correct, k=6)
    with pytest.raises(ValueError, match="differ in length"):
        maj_at_k(answers, correct[:2])


# ---------------------------------------------------------------- bootstrap


def test_bootstrap_ci_deterministic_contains_mean_and_shrinks():
    rng = random.Random(1)
    small = [float(rng.random() < 0.4) for _ in range(30)]
    big = [float(rng.random() < 0.4) for _ in range(3000)]
    a, b = bootstrap_ci(small, seed=3), bootstrap_ci(small, seed=3)
    assert a == b and isinstance(a[0], float)
    cont = [rng.random() for _ in range(30)]
    assert bootstrap_ci(cont, seed=4) != bootstrap_ci(cont, seed=3)  # the seed is used
    for vals in (small, big):
        low, high = bootstrap_ci(vals)
        assert low <= sum(vals) / len(vals) <= high
    assert (lambda c: c[1] - c[0])(bootstrap_ci(big)) < (lambda c: c[1] - c[0])(bootstrap_ci(small)) / 3
    assert bootstrap_ci([0.25]) == (0.25, 0.25)
    lo95, hi95 = bootstrap_ci(small)
    lo90, hi90 = bootstrap_ci(small, level=0.9)  # same seed -> same resamples -> nested interval
    assert lo95 <= lo90 <= hi90 <= hi95


def test_bootstrap_ci_errors():
    with pytest.raises(ValueError, match="empty"):
        bootstrap_ci([])
    with pytest.raises(ValueError, match="finite"):
        bootstrap_ci([0.0, float("nan")])
    with pytest.raises(ValueError, match="level"):
        bootstrap_ci([0.0, 1.0], level=1.0)
    with pytest.raises(ValueError, match="n_boot"):
        bootstrap_ci([0.0, 1.0], n_boot=0)


# ---------------------------------------------------------------- summarize_benchmark


def _rec(q, ep, *, correct=False, answer=None, failed=False, bench="aime", comps=None,
         finish="stop", turns=1, tool_calls=0, tokens=10):
    return {"benchmark": bench, "sample_id": f"q{q}", "sample_index": q, "episode": ep, "seed": ep,
            "correct": correct, "reward": float(correct), "failed": failed, "answer": answer,
            "score_components": comps or {"correct": float(correct)}, "response_tokens": tokens,
            "turns": turns, "tool_calls": tool_calls,
            "finish_reason": "error:sandbox" if failed else finish}


def _math_records():
    return [
        # q0: 4 episodes, 2 correct ("5"), majority "7" (wrong).
        _rec(0, 0, answer="7"), _rec(0, 1, correct=True, answer="5"),
        _rec(0, 2, answer="7"), _rec(0, 3, correct=True, answer="5", finish="length"),
        # q1: 1 failed -> n_1 = 3, all correct.
        _rec(1, 0, correct=True, answer="2"), _rec(1, 1, failed=True),
        _rec(1, 2, correct=True, answer="2"), _rec(1, 3, correct=True, answer="2"),
        # q2: every episode failed -> failed question, excluded.
        *[_rec(2, e, failed=True) for e in range(4)],
        # q3: 4 episodes, 0 correct, majority answer "9".
        *[_rec(3, e, answer="9", turns=3, tool_calls=2) for e in range(4)],
    ]


def test_summarize_math_excludes_and_counts_failures():
    recs = _math_records()
    s = summarize_benchmark(recs, "math")
    assert s["benchmark"] == "aime" and s["kind"] == "math" and s["headline"] == "avg@4"
    assert (s["questions"], s["episodes"], s["failed_episodes"], s["failed_questions"]) == (3, 11, 5, 1)
    assert (s["n"], s["min_n"], s["max_n"]) == (4, 3, 4)
    # Failed episodes are excluded (q1 is 3/3, not 3/4).
    assert s["avg@4"] == pytest.approx((0.5 + 1.0 + 0.0) / 3)
    # Default ks: powers of two <= min n_i = 3, plus 3.
    assert [k for k in s if k.startswith("pass@") and not k.endswith(("_ci95", "_questions"))] == [
        "pass@1", "pass@2", "pass@3"]
    assert s["pass@1"] == pytest.approx(s["avg@4"])
    assert s["pass@2"] == pytest.approx((pass_at_k(4, 2, 2) + 1.0 + 0.0) / 3)
    # q0: "7" and "5" tie 2-2 -> "7" (first occurrence), wrong; q1 right; q3 wrong.
    assert s["maj@4"] == pytest.approx(1 / 3)
    for m in ("avg@4", "pass@1", "pass@2", "pass@3", "maj@4"):
        low, high = s[m + "_ci95"]
        assert low <= s[m] <= high
    assert s["mean_turns"] == pytest.approx((7 * 1 + 4 * 3) / 11)
    assert s["mean_tool_calls"] == pytest.approx(8 / 11)
    assert s["tool_call_rate"] == pytest.approx(4 / 11)  # q3's 4 scored episodes called a tool
    assert s["answer_rate"] == pytest.approx(1.0)
    assert s["mean_response_tokens"] == pytest.approx(10.0)
    assert s["finish/stop"] == pytest.approx(10 / 11) and s["finish/length"] == pytest.approx(1 / 11)
    assert "finish/error" not in s and s["failed/error"] == 5
    assert summarize_benchmark(list(reversed(recs)), "math") == s  # deterministic, order-free
    json.dumps(s, allow_nan=False)


def test_summarize_math_explicit_ks_skip_short_questions():
    s = summarize_benchmark(_math_records(), "math", ks=[4, 1, 8])
    assert s["pass@4"] == pytest.approx((1.0 + 0.0) / 2)  # q1 (n_1 = 3) skipped for k=4
    assert s["pass@4_questions"] == 2 and "pass@1_questions" not in s
    assert s["pass@8"] is None and s["pass@8_ci95"] is None and s["pass@8_questions"] == 0
    with pytest.raises(ValueError, match="ks"):
        summarize_benchmark(_math_records(), "math", ks=[0])


def test_summarize_qa_means_per_question_then_over_questions():
    def qa(q, ep, em, sub, f1, failed=False):
        return _rec(q, ep, correct=em == 1.0, answer="x", bench="nq", failed=failed,
                    comps={"em": em, "substring_em": sub, "f1": f1, "has_answer": 1.0})
    recs = [qa(0, 0, 1.0, 1.0, 1.0), qa(0, 1, 0.0, 1.0, 0.5),
            qa(1, 0, 0.0, 0.0, 0.2), qa(1, 1, 0.0, 0.0, 0.0, failed=True)]
    s = summarize_benchmark(recs, "qa")
    assert s["headline"] == "em" and s["questions"] == 2 and s["failed_episodes"] == 1
    assert s["em"] == pytest.approx((0.5 + 0.0) / 2)
    assert s["f1"] == pytest.approx((0.75 + 0.2) / 2)
    assert s["cover_em"] == pytest.approx((1.0 + 0.0) / 2)
    assert all(s[m + "_ci95"][0] <= s[m] <= s[m + "_ci95"][1] for m in ("em", "f1", "cover_em"))
    assert not any(k.startswith(("pass@", "avg@", "maj@")) for k in s)
    bad = [dict(recs[0], score_components={"em": 1.0})]
    with pytest.raises(ValueError, match=r"lacks score component"):
        summarize_benchmark(bad, "qa")


def test_summarize_edge_cases_and_errors():
    s = summarize_benchmark([_rec(0, 0, failed=True)], "math")
    assert s["questions"] == 0 and s["failed_questions"] == 1 and s["avg@1"] is None
    assert s["mean_turns"] is None
    assert summarize_benchmark([], "qa")["em"] is None
    with pytest.raises(ValueError, match="kind"):
        summarize_benchmark([], "code")
    with pytest.raises(ValueError, match="duplicate"):
        summarize_benchmark([_rec(0, 0), _rec(0, 0)], "math")
    with pytest.raises(ValueError, match="more than one benchmark"):
        summarize_benchmark([_rec(0, 0), _rec(1, 0, bench="nq")], "math")


def test_default_ks():
    assert default_ks(32) == [1, 2, 4, 8, 16, 32]
    assert default_ks(12) == [1, 2, 4, 8, 12]
    assert default_ks(1) == [1] and default_ks(0) == []


# ---------------------------------------------------------------- report


def test_write_report(tmp_path):
    per = {"aime": summarize_benchmark(_math_records(), "math"),
           "nq": summarize_benchmark([_rec(0, 0, correct=True, bench="nq",
                                           comps={"em": 1.0, "substring_em": 1.0, "f1": 1.0})], "qa")}
    header = {"model": "Qwen/Qwen3-1.7B", "engine": "sglang", "k": 4, "temperature": 0.6,
              "seeds": [0, 1], "date": "2025-01-01T00:00:00Z", "extra": "x"}
    paths = write_report(tmp_path / "out", header, per)
    assert set(paths) == {"json", "md", "png"}
    assert all(p.exists() and p.stat().st_size > 0 for p in paths.values())
    assert paths["png"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert json.loads(paths["json"].read_text()) == {"header": header, "benchmarks": per}
    md = paths["md"].read_text()
    rows = [ln for ln in md.splitlines() if ln.startswith("| ") and not ln.startswith("| benchmark")]
    assert [r.split("|")[1].strip() for r in rows] == ["aime", "nq"]
    aime = per["aime"]
    assert format_metric(aime["avg@4"], aime["avg@4_ci95"]) in rows[0] and "avg@4" in rows[0]
    assert "Qwen/Qwen3-1.7B" in md and "0, 1" in md
    assert [p.name for p in (tmp_path / "out").iterdir() if p.name.startswith(".")] == []  # no temp left
    # Rewriting replaces the files.
    write_report(tmp_path / "out", header, {"nq": per["nq"]})
    assert list(json.loads(paths["json"].read_text())["benchmarks"]) == ["nq"]


def test_format_metric():
    assert format_metric(0.41234, [0.3456, 0.4712]) == "0.412 [0.35, 0.47]"
    assert format_metric(None) == "—" and format_metric(0.5) == "0.500"
