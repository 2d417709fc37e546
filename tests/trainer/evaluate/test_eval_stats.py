"""The one statistics module of evaluation (trainer/evaluate/stats.py) against hand-computed values,
and the check that no other module of the package defines a second copy of its estimators."""

from __future__ import annotations

import ast
import math
from pathlib import Path

import numpy as np
import pytest

from trainer.evaluate.stats import (
    bootstrap_ci,
    normal_mean_interval,
    paired_bootstrap,
    pass_at_k,
    proportion_or_mean_interval,
    wilson_interval,
)

REPO = Path(__file__).parent.resolve().parents[2]


def test_wilson_3_of_10_by_hand():
    # p = 0.3, n = 10, z² = 1.959964² = 3.8414588; 1 + z²/n = 1.3841459
    # centre = (0.3 + 3.8414588/20) / 1.3841459 = 0.4920729 / 1.3841459 = 0.3555066
    # half = 1.959964 / 1.3841459 · sqrt(0.21/10 + 3.8414588/400) = 1.4160135 · 0.1749389 = 0.2477153
    low, high = wilson_interval(3 / 10, 10)
    assert low == pytest.approx(0.3555066 - 0.2477153, abs=2e-7)
    assert high == pytest.approx(0.3555066 + 0.2477153, abs=2e-7)
    assert (low, high) == pytest.approx((0.1077913, 0.6032219), abs=1e-7)  # the textbook [0.108, 0.603]
    # 0 of 40: [0, z²/(n + z²)] = [0, 3.8414588 / 43.8414588]
    assert wilson_interval(0.0, 40) == pytest.approx((0.0, 0.0876216), abs=1e-7)
    # the bound at 0 / n and n / n is exactly 0 / 1, not a rounding residue (was 3.5e-18 at 0 of 256)
    assert wilson_interval(0.0, 256)[0] == 0.0 and wilson_interval(1.0, 256)[1] == 1.0


def test_held_out_interval_is_wilson_for_k1_and_effective_size_wilson_for_k2():
    assert proportion_or_mean_interval([1.0, 0.0, 0.0, 1.0, 1.0], 1) == wilson_interval(3 / 5, 5)
    # [0, .5, 1], k = 2: p̂ = .5, s² = .25, n_eff = .25 · 3 / .25 = 3 (in [3, 6]) → Wilson(.5, 3):
    # centre .5, half 1.959964 / 2.2804863 · sqrt(.25/3 + z²/36) = .8594522 · .4359368 = .3746655
    assert proportion_or_mean_interval([0.0, 0.5, 1.0], 2) == pytest.approx((0.1253345, 0.8746655), abs=1e-7)
    assert normal_mean_interval([0.0, 0.5, 1.0]) == (0.0, 1.0)  # the normal interval, clipped
    # [.5, .75, .75, 1], k = 4: n_eff = .1875 · 4 / .0416667 = 18, capped at the 16 samples
    low, high = proportion_or_mean_interval([0.5, 0.75, 0.75, 1.0], 4)
    assert (low, high) == wilson_interval(0.75, 16)
    assert (low, high) == pytest.approx((0.5050168, 0.8981793), abs=1e-7)
    assert all(math.isnan(v) for v in proportion_or_mean_interval([], 1))


def test_paired_bootstrap_constant_shift_is_exact():
    before = {f"q{i}": (i % 4) / 4 for i in range(20)}
    after = {q: v + 0.25 for q, v in before.items()}  # every question gains exactly 0.25
    for seed in (0, 1, 123):
        assert paired_bootstrap(before, after, n_boot=500, seed=seed) == \
            {"mean": 0.25, "ci95_low": 0.25, "ci95_high": 0.25, "n": 20}


def test_paired_bootstrap_hand_built_pair_with_fixed_seed():
    # five questions, before [1, 0, 1, 0, 0], after [1, 1, 1, 0, 1]: q1 and q4 gained, Δ = 2/5
    before = {"a": 1.0, "b": 0.0, "c": 1.0, "d": 0.0, "e": 0.0, "only_before": 1.0}
    after = {"a": 1.0, "b": 1.0, "c": 1.0, "d": 0.0, "e": 1.0, "only_after": 0.0}
    d = paired_bootstrap(before, after, n_boot=400, seed=7)
    assert d["mean"] == pytest.approx(0.4) and d["n"] == 5  # unpaired questions left out
    # the percentile bootstrap by hand, on the differences in sorted key order a..e = [0, 1, 0, 0, 1]
    diffs = np.array([0.0, 1.0, 0.0, 0.0, 1.0])
    means = diffs[np.random.default_rng(7).integers(0, 5, size=(400, 5))].mean(axis=1)
    assert (d["ci95_low"], d["ci95_high"]) == pytest.approx(tuple(np.quantile(means, [0.025, 0.975])))
    # a resample mean is k/5 for k ones drawn (Binomial(5, 0.4)): P(0) = 0.6⁵ = 0.078 > 2.5 % and
    # P(5) = 0.4⁵ = 0.010, P(4 or 5) = 5·0.4⁴·0.6 + 0.010 = 0.087 > 2.5 %: the bounds are 0 and 0.8
    assert (d["ci95_low"], d["ci95_high"]) == (0.0, 0.8)
    assert paired_bootstrap(before, after, n_boot=400, seed=7) == d  # deterministic for a seed
    assert paired_bootstrap(after, before, n_boot=400, seed=7)["mean"] == pytest.approx(-0.4)


def test_paired_bootstrap_no_common_question_and_errors():
    d = paired_bootstrap({"a": 1.0}, {"b": 1.0})
    assert d["n"] == 0 and all(math.isnan(d[k]) for k in ("mean", "ci95_low", "ci95_high"))
    for bad in (0, -3, 1.5, True):
        with pytest.raises(ValueError, match="n_boot"):
            paired_bootstrap({"a": 1.0}, {"a": 0.0}, n_boot=bad)


def test_bootstrap_two_values_by_hand():
    # [0, 1]: a resample's mean is 0, .5 or 1 with chances 1/4, 1/2, 1/4 — both tails hold > 2.5 %
    assert bootstrap_ci([0.0, 1.0], n_boot=2000, seed=3) == (0.0, 1.0)
    assert bootstrap_ci([0.7], n_boot=10) == (0.7, 0.7)


def test_pass_at_k_by_hand():
    # n = 5, c = 2: pass@2 = 1 − C(3,2)/C(5,2) = 1 − 3/10; pass@3 = 1 − C(3,3)/C(5,3) = 1 − 1/10
    assert pass_at_k(5, 2, 2) == pytest.approx(0.7) and pass_at_k(5, 2, 3) == pytest.approx(0.9)
    assert pass_at_k(5, 2, 4) == 1.0 and pass_at_k(5, 2, 1) == pytest.approx(0.4)


def test_no_second_copy_of_the_statistics_in_the_package():
    """Wilson / normal / bootstrap / paired bootstrap / pass@k / majority vote are defined once."""
    names = {"wilson_interval", "normal_mean_interval", "bootstrap_ci", "paired_bootstrap", "pass_at_k",
             "maj_at_k", "majority_answer", "paired_difference", "proportion_or_mean_interval",
             "clustered_proportion_interval"}
    found: dict[str, list[str]] = {}
    for pkg in ("copc", "environments", "retriever", "trainer"):
        for path in sorted((REPO / pkg).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.name in names:
                    found.setdefault(node.name, []).append(str(path.relative_to(REPO)))
    stats = "trainer/evaluate/stats.py"
    assert {n: p for n, p in found.items() if n != "paired_difference"} == \
        {n: [stats] for n in names - {"paired_difference"}}
    assert found["paired_difference"] == ["trainer/evaluate/heldout.py"]  # records → paired_bootstrap
    assert not (REPO / "trainer" / "evaluation.py").exists()
