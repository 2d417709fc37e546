"""scripts/critic_arms_report.py's paired table and power statement (issue 46, item 4): the
detectable difference against hand-computed t quantiles, and the paired differences of a small
hand-made sweep."""

from __future__ import annotations

import json
import math

import pytest


def test_detectable_difference_by_hand(report):
    """n = 5 pairs, sd 0.05: (t_0.975,4 = 2.7764 + t_0.8,4 = 0.9410) * 0.05 / sqrt 5 = 0.08313;
    n = 10, sd 0.1: (2.2622 + 0.8834) * 0.1 / sqrt 10 = 0.09947; fewer than 2 pairs: NaN."""
    assert report.detectable(0.05, 5) == pytest.approx(0.08313, abs=2e-5)
    assert report.detectable(0.1, 10) == pytest.approx(0.09947, abs=2e-5)
    assert math.isnan(report.detectable(0.05, 1))


def test_paired_rows_pair_by_seed_and_skip_missing(report):
    """copc − copc_wo_rc at lag 16 over seeds 0-2 (seed 3 has no copc_wo_rc run: not paired):
    differences 0.1, 0.0, 0.2 -> mean 0.1, sd 0.1, 95 % half-width t_0.975,2 * 0.1 / sqrt 3 = 0.2484."""
    recs = [{"preset": "copc", "lag": 16, "seed": s, "after": a} for s, a in enumerate([0.6, 0.5, 0.7, 0.9])]
    recs += [{"preset": "copc_wo_rc", "lag": 16, "seed": s, "after": 0.5} for s in range(3)]
    rows = report.paired_rows(recs)
    assert len(rows) == 1
    r = rows[0]
    assert (r["a"], r["b"], r["n"]) == ("copc", "copc_wo_rc", 3)
    assert r["mean"] == pytest.approx(0.1) and r["sd"] == pytest.approx(0.1)
    assert r["hi"] - r["mean"] == pytest.approx(0.24841, abs=1e-4)
    assert "| 16 | copc − copc_wo_rc | 3 | +0.100 |" in report.paired_report(recs)


def test_late_means_average_the_last_steps_and_every_staleness_key(report, tmp_path):
    """Only rows of RL steps count (``actor/updated``), the last ``last`` of them; the per-staleness
    ``diag/abs_log_ratio_s<k>`` keys pool into ``diag/abs_log_ratio``; a key never logged is NaN."""
    rows = [{"eval/accuracy": 0.5},
            {"actor/updated": 1, "x": 9.0, "diag/abs_log_ratio_s1": 9.0},
            {"actor/updated": 1, "x": 1.0, "diag/abs_log_ratio_s2": 0.1, "diag/abs_log_ratio_s3": 0.3},
            {"actor/updated": 1, "x": 3.0, "diag/abs_log_ratio_s3": 0.2}]
    f = tmp_path / "metrics.jsonl"
    f.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    out = report._late_means(report.rl_steps(f), ("x", "diag/abs_log_ratio", "missing"), last=2)
    assert out["x"] == pytest.approx(2.0) and out["diag/abs_log_ratio"] == pytest.approx(0.2)
    assert math.isnan(out["missing"])


def test_runs_read_the_named_metric(report, tmp_path):
    """A hand-made run of preset copc_wo_rc at lag 16, seed 1: with ``metric="em"`` before / after are
    the summary's ``em`` (0.024 / 0.066), with the default its ``accuracy`` (0.1 / 0.2)."""
    run = tmp_path / "cells" / "presetcopc_wo_rc_lag16" / "seed1"
    run.mkdir(parents=True)
    (run / "config.yaml").write_text("name: x\npreset: copc_wo_rc\n")
    (run / "summary.json").write_text(json.dumps({"eval_before": {"accuracy": 0.1, "em": 0.024},
                                                  "eval_after": {"accuracy": 0.2, "em": 0.066}}))
    (run / "metrics.jsonl").write_text(json.dumps({"actor/updated": 1, "actor/grad_norm": 0.5}) + "\n")
    (em,) = report.runs(tmp_path, "em")
    assert (em["preset"], em["lag"], em["seed"]) == ("copc_wo_rc", 16, 1)
    assert (em["before"], em["after"]) == (0.024, 0.066)
    assert em["actor/grad_norm"] == 0.5
    (acc,) = report.runs(tmp_path)
    assert (acc["before"], acc["after"]) == (0.1, 0.2)
