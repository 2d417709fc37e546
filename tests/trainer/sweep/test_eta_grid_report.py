"""scripts/eta_grid_report.py (issue 46, item 4: the η_P × η_A grid): the interaction F test against
an independent least-squares fit of nested models, hand-computed sums of squares, the paired η_A
effects by hand, and the records read from a hand-made sweep directory."""

from __future__ import annotations

import itertools
import json

import numpy as np
import pytest
import yaml


def _design(keys, interaction: bool) -> np.ndarray:
    """Dummy-coded design: intercept, seeds, η_P, η_A (and their products when ``interaction``)."""
    ps, as_, ss = (sorted({k[i] for k in keys}) for i in range(3))
    cols = []
    for p, a, s in keys:
        row = [1.0] + [float(s == x) for x in ss[1:]] + [float(p == x) for x in ps[1:]]
        row += [float(a == x) for x in as_[1:]]
        if interaction:
            row += [float(p == x and a == z) for x in ps[1:] for z in as_[1:]]
        cols.append(row)
    return np.array(cols)


def test_interaction_f_equals_the_nested_least_squares_fit(grid):
    """3 η_P x 4 η_A x 3 seeds of random accuracies: F and p equal those of the nested-model test
    (full model with the interaction against the additive one, both fitted by numpy lstsq) to 1e-9;
    each main effect's F equals the additive model against the one without that factor (balanced
    design), over the full model's residual mean square."""
    from scipy.stats import f as f_dist

    rng = np.random.default_rng(0)
    keys = list(itertools.product([0.25, 0.5, 1.0], [0.0, 0.25, 0.5, 1.0], [0, 1, 2]))
    y = rng.uniform(0, 0.6, len(keys))
    t = grid.interaction_test(dict(zip(keys, y, strict=True)))
    rss = {}
    for inter in (False, True):
        X = _design(keys, inter)
        beta = np.linalg.lstsq(X, y, rcond=None)[0]
        rss[inter] = float(((y - X @ beta) ** 2).sum())
    df_ab, df_err = 2 * 3, (12 - 1) * 2
    F = ((rss[False] - rss[True]) / df_ab) / (rss[True] / df_err)
    assert (t["df_ab"], t["df_err"]) == (df_ab, df_err)
    assert t["F"] == pytest.approx(F, rel=1e-9)
    assert t["p"] == pytest.approx(float(f_dist.sf(F, df_ab, df_err)), rel=1e-9)
    assert t["ss_err"] == pytest.approx(rss[True], rel=1e-9)
    for name, df in (("_a", 2), ("_b", 3)):  # main effects: the additive fit without one factor
        X = _design(keys, False)
        cols = [0, 1, 2] + ([3, 4] if name == "_b" else []) + ([5, 6, 7] if name == "_a" else [])
        beta = np.linalg.lstsq(X[:, cols], y, rcond=None)[0]
        rss_without = float(((y - X[:, cols] @ beta) ** 2).sum())
        F_main = ((rss_without - rss[False]) / df) / (rss[True] / df_err)  # balanced: SS by difference
        assert t[f"F{name}"] == pytest.approx(F_main, rel=1e-9), name
        assert t[f"p{name}"] == pytest.approx(float(f_dist.sf(F_main, df, df_err)), rel=1e-9)


def test_additive_data_have_no_interaction_and_a_reversal_has_a_large_one(grid):
    """y = seed + η_P + η_A effects exactly: SS_AB = 0 to 1e-12 (with a ±1e-3 alternating noise: < 1e-5,
    p > 0.5). A
    reversal (η_A helps at η_P = 1 by +0.2, hurts at η_P = 0.25 by 0.2; 2 x 2, 2 seeds, seed offsets
    0 and 0.1; every interaction term ȳ_ij − ȳ_i − ȳ_j + ȳ is ±0.1): SS_AB = 2 · 4 · 0.1² = 0.08."""
    keys = list(itertools.product([0.25, 0.5, 1.0], [0.0, 0.5, 1.0], [0, 1, 2]))
    noise = {k: 1e-3 * (-1) ** i for i, k in enumerate(keys)}
    exact = {k: 0.1 * k[2] + 0.3 * k[0] - 0.05 * k[1] for k in keys}
    t = grid.interaction_test({k: v + noise[k] for k, v in exact.items()})
    assert t["ss_ab"] < 1e-5 and t["p"] > 0.5
    t = grid.interaction_test(exact)  # no residual and no interaction: F 0, p 1 (not a rounding F = inf)
    assert t["ss_ab"] == pytest.approx(0.0, abs=1e-12) and (t["F"], t["p"]) == (0.0, 1.0)
    rev = {(0.25, 0.0, 0): 0.3, (0.25, 1.0, 0): 0.1, (1.0, 0.0, 0): 0.3, (1.0, 1.0, 0): 0.5}
    rev.update({(p, a, 1): v + 0.1 for (p, a, _), v in list(rev.items())})
    t = grid.interaction_test(rev)
    assert t["ss_ab"] == pytest.approx(0.08, abs=1e-12)
    assert t["ss_err"] == pytest.approx(0.0, abs=1e-12)
    assert t["F"] == float("inf") and t["p"] == 0.0


def test_an_incomplete_grid_is_refused_naming_its_shape(grid):
    """A seed missing one cell: ValueError naming the grid's shape and run count; a NaN accuracy:
    ValueError (not an all-NaN result)."""
    keys = list(itertools.product([0.25, 1.0], [0.0, 1.0], [0, 1]))
    with pytest.raises(ValueError, match="2 eta_p x 2 eta_a x 2 seeds with 7 runs"):
        grid.interaction_test({k: 0.1 for k in keys[:-1]})
    with pytest.raises(ValueError, match="not finite"):
        grid.interaction_test({k: float("nan") if i == 0 else 0.1 for i, k in enumerate(keys)})


def test_eta_a_effects_pair_by_seed(grid):
    """η_P 0.5, lag 16: η_A 0.5 − η_A 0 per seed = 0.1, 0.0, 0.2 -> mean 0.1, sd 0.1, 95 % interval
    ± t_0.975,2 · 0.1 / √3 = ± 0.2484; a seed without its η_A = 0 run is not paired."""
    recs = [{"lag": 16, "eta_p": 0.5, "eta_a": 0.0, "seed": s, "after": v, "before": 0.3}
            for s, v in enumerate([0.3, 0.4, 0.2])]
    recs += [{"lag": 16, "eta_p": 0.5, "eta_a": 0.5, "seed": s, "after": v, "before": 0.3}
             for s, v in enumerate([0.4, 0.4, 0.4, 0.9])]
    (e,) = grid.eta_a_effects(recs)
    assert (e["eta_p"], e["eta_a"], e["n"]) == (0.5, 0.5, 3)
    assert e["mean"] == pytest.approx(0.1) and e["sd"] == pytest.approx(0.1)
    assert e["lo"] == pytest.approx(0.1 - 0.2484, abs=1e-4)
    assert e["hi"] == pytest.approx(0.1 + 0.2484, abs=1e-4)


def _run(root, name: str, eta: tuple[float, float], seed: int, summary: dict) -> None:
    run = root / "cells" / name / f"seed{seed}"
    run.mkdir(parents=True)
    (run / "config.yaml").write_text(yaml.safe_dump({
        "algorithm": {"policy_loss_settings": {"eta_p": eta[0]}, "estimator_settings": {"eta_a": eta[1]}},
        "train": {"seed": seed, "staleness": {"mode": "fixed", "lag": 64}}}))
    (run / "summary.json").write_text(json.dumps(summary))


def test_runs_read_a_sweep_directory(grid, tmp_path):
    """Two hand-made runs: η_P, η_A, lag and seed from each run's config.yaml, before / after from
    its summary.json; a run without summary.json (unfinished) is not a run; a run whose after-RL
    accuracy is NaN (every evaluation episode failed) or that has no evaluation after RL is left
    out and named; the report names both cells."""
    for i, eta in enumerate([(0.5, 0.0), (1.0, 0.25)]):
        _run(tmp_path, f"c{i}", eta, 2, {"eval_before": {"accuracy": 0.25},
                                         "eval_after": {"accuracy": 0.25 + 0.1 * i}})
    (tmp_path / "cells" / "c2" / "seed0").mkdir(parents=True)
    _run(tmp_path, "c3", (0.5, 0.5), 1, {"eval_before": {"accuracy": 0.25},
                                         "eval_after": {"accuracy": float("nan")}})
    _run(tmp_path, "c4", (0.5, 1.0), 1, {"eval_before": {"accuracy": 0.25}})
    recs, skipped = grid.runs([tmp_path])
    assert recs == [{"eta_p": 0.5, "eta_a": 0.0, "lag": 64, "seed": 2, "before": 0.25, "after": 0.25},
                    {"eta_p": 1.0, "eta_a": 0.25, "lag": 64, "seed": 2, "before": 0.25, "after": 0.35}]
    assert len(skipped) == 2 and "c3/seed1: accuracy before 0.25, after nan" in skipped[0]
    assert "c4/seed1: no 'eval_after'" in skipped[1]
    text = grid.report(recs)
    assert "| 0.5 | 0.250 [+0.000] | – | 0.250 |" in text and "| 1 | – | 0.350 [+0.100] | 0.350 |" in text
    assert "| all η_P | 0.250 | 0.350 | 0.300 |" in text
    assert "no interaction test" in text


def test_the_same_run_in_two_sweep_directories_is_refused(grid, tmp_path):
    """Two directories holding (lag, η_P, η_A, seed) = (64, 0.5, 0, 0) both: ValueError naming both."""
    for d in ("a", "b"):
        _run(tmp_path / d, "c", (0.5, 0.0), 0, {"eval_before": {"accuracy": 0.2},
                                                "eval_after": {"accuracy": 0.3}})
    with pytest.raises(ValueError, match=r"a/cells/c/seed0 and .*b/cells/c/seed0 are the same run"):
        grid.runs([tmp_path / "a", tmp_path / "b"])


def test_channel_table_takes_the_median_over_seeds_of_late_means(grid, tmp_path):
    """Cell (64, 0.5, 0): three seeds whose RL steps log a masked share of 0.1 / 0.2 / 0.6 (a row
    without ``actor/updated`` is not an RL step) -> median 0.2; |log ρ| pooled from the per-staleness
    keys; a key never logged prints nan."""
    for seed, masked in enumerate([0.1, 0.2, 0.6]):
        _run(tmp_path, "c", (0.5, 0.0), seed, {"eval_before": {"accuracy": 0.2},
                                               "eval_after": {"accuracy": 0.3}})
        rows = [{"diag/policy_masked_frac": 9.0},
                {"actor/updated": 1, "diag/policy_masked_frac": masked, "diag/abs_log_ratio_s64": 0.05}]
        (tmp_path / "cells" / "c" / f"seed{seed}" / "metrics.jsonl").write_text(
            "\n".join(json.dumps(r) for r in rows) + "\n")
    text = grid.channel_table([tmp_path])
    assert "| 64 | 0.5 | 0 | 0.05 | 0.2 | nan | nan |" in text
