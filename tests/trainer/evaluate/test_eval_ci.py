"""Confidence intervals of the held-out evaluation, per-question records and the paired
before/after comparison (issue 13)."""

from __future__ import annotations

import io
import json
import math
from pathlib import Path

import numpy as np
import pytest
from rich.console import Console

from trainer.config import load_config
from trainer.evaluate.heldout import episode_records, eval_delta, paired_difference, summarize
from trainer.evaluate.records import read_records, write_records
from trainer.evaluate.stats import Z95, normal_mean_interval, wilson_interval
from trainer.outputs.metrics_log import read_metrics
from trainer.outputs.report import format_delta, format_with_ci, print_report
from trainer.rollout.trajectory import Trajectory

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def traj(reward: float, sid=None, em=None, finish="terminated", **info) -> Trajectory:
    if em is not None:
        info["reward_components"] = {"em": em}
    return Trajectory(prompt_ids=[1], reward=reward, sample_id=sid, turns=2, finish_reason=finish, info=info)


# --- Wilson score interval (Wilson 1927, JASA 22:209) ------------------------------------------

def test_wilson_17_of_334_by_hand():
    # p = 17/334 = 0.0508982; z² = 1.959964² = 3.8414588; 1 + z²/n = 1.0115014
    # centre = (p + z²/668) / 1.0115014 = (0.0508982 + 0.0057507) / 1.0115014 = 0.0560048
    # half = 1.959964 / 1.0115014 · sqrt(p(1-p)/334 + z²/(4·334²)) = 1.9376786 · 0.0123790 = 0.0239867
    low, high = wilson_interval(17 / 334, 334)
    assert low == pytest.approx(0.0560048 - 0.0239867, abs=2e-7)
    assert high == pytest.approx(0.0560048 + 0.0239867, abs=2e-7)
    assert (low, high) == pytest.approx((0.0320180, 0.0799915), abs=1e-7)


def test_wilson_edge_cases():
    z2 = Z95 ** 2
    assert wilson_interval(0.0, 20) == pytest.approx((0.0, z2 / (20 + z2)), abs=1e-15)
    assert wilson_interval(1.0, 10) == pytest.approx((10 / (10 + z2), 1.0), abs=1e-15)
    assert wilson_interval(1.0, 10)[0] == pytest.approx(0.7224672, abs=1e-7)
    assert all(math.isnan(v) for v in wilson_interval(0.0, 0))
    with pytest.raises(ValueError, match=r"p_hat=1\.5"):
        wilson_interval(1.5, 3)
    with pytest.raises(ValueError, match=r"n=-1"):
        wilson_interval(0.5, -1)


def test_wilson_matches_scipy_when_available():
    stats = pytest.importorskip("scipy.stats")
    for x, n in [(17, 334), (0, 5), (5, 5), (1, 2), (250, 500)]:
        ref = stats.binomtest(x, n).proportion_ci(method="wilson")
        assert wilson_interval(x / n, n) == pytest.approx((ref.low, ref.high), abs=1e-12)


def test_normal_interval_by_hand_and_clipped():
    # [0, .5, 1, 1]: mean .625, s² = (.390625 + .015625 + .140625·2) / 3 = .2291667, s = .4787136
    # half = 1.959964 · .4787136 / 2 = .4691307 → [.1558693, 1.0943307 → 1]
    low, high = normal_mean_interval([0.0, 0.5, 1.0, 1.0])
    assert low == pytest.approx(0.625 - Z95 * math.sqrt(0.6875 / 3) / 2, abs=1e-12)
    assert low == pytest.approx(0.1558693, abs=1e-7) and high == 1.0
    assert normal_mean_interval([0.5, 0.5, 0.5]) == (0.5, 0.5)
    assert all(math.isnan(v) for v in normal_mean_interval([0.5]))


# --- summarize --------------------------------------------------------------------------------

def test_summarize_k1_wilson_over_scored_problems():
    trajs = [traj(1.0 if i < 17 else 0.0, sid=i, em=1.0 if i < 10 else 0.0) for i in range(334)]
    trajs += [traj(0.0, sid=1000 + i, finish="infra_error: sandbox") for i in range(5)]  # not scored
    m = summarize(trajs, 1)
    assert m["n"] == 334 and m["infra_failed"] == 5
    assert m["accuracy"] == pytest.approx(17 / 334)
    ci = (m["accuracy_ci95_low"], m["accuracy_ci95_high"])
    assert ci == pytest.approx((0.0320180, 0.0799915), abs=1e-7)
    assert (m["em_ci95_low"], m["em_ci95_high"]) == pytest.approx(wilson_interval(10 / 334, 334), abs=1e-15)
    assert all(isinstance(v, float) for v in m.values())


def test_summarize_answer_rate_counts_scored_episodes_with_an_extracted_answer():
    """``answer_rate`` (issue 45 item 2: the math job's table): 3 of the 5 scored episodes carry a
    ``final_answer`` (one of them wrong); the failed episode with an answer is not counted."""
    trajs = [traj(1.0, sid=0, final_answer="72"), traj(0.0, sid=1, final_answer="7"),
             traj(1.0, sid=2, final_answer="10"), traj(0.0, sid=3), traj(0.0, sid=4),
             traj(0.0, sid=5, final_answer="1", finish="infra_error: sandbox")]
    m = summarize(trajs, 1)
    assert m["n"] == 5 and m["answer_rate"] == pytest.approx(3 / 5) and m["accuracy"] == pytest.approx(2 / 5)
    assert summarize([traj(0.0, sid=0)], 1)["answer_rate"] == 0.0


def test_summarize_k2_effective_size_wilson_of_per_problem_avg():
    outcomes = [(0, 0), (1, 0), (1, 1), (1, 1)]  # per-problem avg@2: 0, .5, 1, 1
    trajs = [traj(float(c), sid=i) for i, pair in enumerate(outcomes) for c in pair]
    m = summarize(trajs, 2)
    assert m["accuracy"] == 0.625 and "em_ci95_low" not in m
    # s² = .2291667, n_eff = .625 · .375 · 4 / .2291667 = 4.0909091 (in [4, 8]); Wilson(.625, 4.0909):
    # 1 + z²/n = 1.9390233, centre .5644654, half .3422962 (the normal interval gave [.1558693, 1])
    ci = (m["accuracy_ci95_low"], m["accuracy_ci95_high"])
    assert ci == pytest.approx((0.2221692, 0.9067617), abs=1e-7)


def test_summarize_no_scored_problem_gives_nan_intervals():
    m = summarize([traj(0.0, sid=0, em=0.0, finish="engine_error: x")], 1)
    assert m["n"] == 0
    assert all(math.isnan(m[k]) for k in ("accuracy_ci95_low", "accuracy_ci95_high"))


# --- per-question records ---------------------------------------------------------------------

def test_episode_records_fields_order_and_atomic_round_trip(tmp_path):
    trajs = [traj(1.0, sid="q0", em=1.0, tool_calls=2, invalid_actions=1, final_answer="Paris"),
             traj(0.0, sid="q0"),  # cut before answering: no em
             traj(0.0, sid="q1", finish="infra_error: retriever down"),
             traj(0.0, sid="q1", em=0.0, final_answer="Rome")]
    recs = episode_records(trajs, 2)
    # the one record schema (trainer.evaluate.records.EpisodeRecord): copy -> episode,
    # final_answer -> answer, infra_failed -> failed, em -> score_components["em"]
    assert [(r["sample_id"], r["sample_index"], r["episode"]) for r in recs] == \
        [("q0", 0, 0), ("q0", 0, 1), ("q1", 1, 0), ("q1", 1, 1)]
    assert recs[0] == {"benchmark": None, "sample_id": "q0", "sample_index": 0, "episode": 0, "seed": None,
                       "prompt": None, "response": None, "turns_text": None, "answer": "Paris", "gold": None,
                       "reward": 1.0,
                       "score_components": {"em": 1.0}, "correct": True, "response_tokens": 0, "turns": 2,
                       "tool_calls": 2, "invalid_actions": 1, "finish_reason": "terminated", "failed": False,
                       "attempts": 1, "llm_s": None, "env_s": None, "other_s": None}  # no clock on these
    assert recs[1]["score_components"].get("em") is None and recs[1]["answer"] is None
    assert recs[2]["failed"] is True and recs[3]["answer"] == "Rome"
    path = write_records(tmp_path / "eval" / "before_rl.jsonl", recs)
    assert read_records(path) == recs
    write_records(path, recs[:1])  # replaced whole, no temporary file left behind
    assert read_records(path) == recs[:1] and [p.name for p in path.parent.iterdir()] == ["before_rl.jsonl"]
    with pytest.raises(ValueError, match="not a positive multiple of k=3"):
        episode_records(trajs, 3)
    path.write_text('{"a": 1}\n{torn')
    with pytest.raises(ValueError, match=r"before_rl\.jsonl:2"):
        read_records(path)


# --- paired difference (Efron & Tibshirani 1993, percentile bootstrap) -------------------------

def recs(values: dict, key: str = "em", copies: int = 1) -> list[dict]:
    """Records with ``values[sid]`` (a scalar, or one value per copy)."""
    out = []
    for i, (sid, v) in enumerate(values.items()):
        vs = v if isinstance(v, list) else [v] * copies
        out += [{"sample_id": sid, "sample_index": i, "copy": c, key: x, "infra_failed": False}
                for c, x in enumerate(vs)]
    return out


def test_paired_identical_is_zero():
    before = recs({f"q{i}": float(i % 3 == 0) for i in range(50)})
    d = paired_difference(before, before)
    assert d == {"metric": "em", "mean": 0.0, "ci95_low": 0.0, "ci95_high": 0.0, "n": 50}


def test_paired_known_shift_matches_a_slow_reference_bootstrap():
    before = recs({f"q{i}": 0.0 for i in range(10)})
    after = recs({f"q{i}": float(i < 3) for i in range(10)})  # 3 of 10 questions gained
    d = paired_difference(before, after, n_boot=2000, seed=5)
    assert d["mean"] == pytest.approx(0.3) and d["n"] == 10
    rng = np.random.default_rng(5)  # the percentile bootstrap, one resample at a time
    diffs = np.array([1.0] * 3 + [0.0] * 7)  # questions sorted by id: q0, q1, q2 gained
    means = [diffs[rng.integers(0, 10, size=10)].mean() for _ in range(2000)]
    assert (d["ci95_low"], d["ci95_high"]) == pytest.approx(tuple(np.quantile(means, [0.025, 0.975])))
    assert 0.0 <= d["ci95_low"] < 0.3 < d["ci95_high"] <= 0.7
    assert paired_difference(after, before, n_boot=2000, seed=5)["mean"] == pytest.approx(-0.3)
    everyone = paired_difference(before, recs({f"q{i}": 1.0 for i in range(10)}))
    assert (everyone["mean"], everyone["ci95_low"], everyone["ci95_high"]) == (1.0, 1.0, 1.0)


def test_paired_means_over_copies_ignores_missing_and_failed():
    before = recs({"a": [1.0, 0.0], "b": [0.0, 0.0], "c": [1.0, 1.0]})
    after = recs({"a": [1.0, 1.0], "b": [1.0, None], "d": [1.0, 1.0]})  # None (no answer) counts 0
    after.append({"sample_id": "c", "sample_index": 9, "copy": 0, "em": 0.0, "infra_failed": True})
    d = paired_difference(before, after)  # c only failed after, d only after: both left out
    assert d["n"] == 2 and d["mean"] == pytest.approx(((1.0 - 0.5) + (0.5 - 0.0)) / 2)
    empty = paired_difference(before, recs({"z": 1.0}))
    assert empty["n"] == 0 and math.isnan(empty["mean"]) and math.isnan(empty["ci95_low"])


def test_paired_accuracy_key_reads_correct_and_no_id_pairs_by_index():
    before = [{"sample_id": None, "sample_index": i, "correct": i == 0, "infra_failed": False}
              for i in range(4)]
    after = [{"sample_id": None, "sample_index": i, "correct": i < 3, "infra_failed": False}
             for i in range(4)]
    d = paired_difference(before, after, key="accuracy")
    assert d["metric"] == "accuracy" and d["n"] == 4 and d["mean"] == pytest.approx(0.5)


def test_paired_is_deterministic_for_a_seed():
    rng = np.random.default_rng(0)
    before = recs({f"q{i}": float(x) for i, x in enumerate(rng.integers(0, 2, 200))})
    after = recs({f"q{i}": float(x) for i, x in enumerate(rng.integers(0, 2, 200))})
    assert paired_difference(before, after, seed=3) == paired_difference(before, after, seed=3)
    assert paired_difference(before, after, seed=3) != paired_difference(before, after, seed=4)
    with pytest.raises(ValueError, match="n_boot=0"):
        paired_difference(before, after, n_boot=0)


def test_eval_delta_prefers_em_and_needs_both_files(tmp_path):
    assert eval_delta(tmp_path) is None
    write_records(tmp_path / "before_rl.jsonl", recs({"a": 0.0, "b": 1.0}))
    write_records(tmp_path / "after_rl.jsonl", recs({"a": 1.0, "b": 1.0}))
    assert eval_delta(tmp_path, n_boot=100)["metric"] == "em"
    unanswered = [{**r, "em": None, "correct": True} for r in recs({"a": 0, "b": 0})]
    write_records(tmp_path / "after_rl.jsonl", unanswered)
    d = eval_delta(tmp_path, n_boot=100)  # no em after: accuracy (before's records have no `correct`: 0)
    assert d["metric"] == "accuracy" and d["mean"] == 1.0


# --- report -----------------------------------------------------------------------------------

def test_report_shows_intervals_and_delta():
    before = {"accuracy": 17 / 334, "accuracy_ci95_low": 0.0320180, "accuracy_ci95_high": 0.0799915,
              "n": 334.0}
    after = {"accuracy": 0.08, "accuracy_ci95_low": 0.055, "accuracy_ci95_high": 0.114, "n": 334.0}
    delta = {"metric": "accuracy", "mean": 0.029, "ci95_low": 0.006, "ci95_high": 0.054, "n": 334}
    assert format_with_ci(before, "accuracy") == "0.051 [0.032, 0.080]"
    assert format_with_ci(before, "n") == "334.000" and format_with_ci({}, "em") == "—"
    assert format_delta(delta) == "+0.029 [+0.006, +0.054] (n=334)" and format_delta({}) == "—"
    buf = io.StringIO()
    print_report({"name": "r", "eval_before": before, "eval_after": after, "eval_delta": delta, "steps": 3},
                 console=Console(file=buf, width=200))
    text = buf.getvalue()
    assert "0.051 [0.032, 0.080]" in text and "0.080 [0.055, 0.114]" in text
    assert "+0.029 [+0.006, +0.054] (n=334)" in text and "paired bootstrap" in text
    assert "ci95" not in text  # the bounds are shown in brackets, not as rows
    buf = io.StringIO()
    tail = {"frac": 0.2, "steps": [20, 24], "rollout/invalid_action_rate": 0.0484, "rollout/tool_calls": 1.0}
    print_report({"name": "r", "eval_before": before, "eval_after": after, "steps": 24, "train_tail": tail},
                 console=Console(file=buf, width=200))
    assert ("Training, last 20% of RL steps (steps 20–24), mean per step: invalid action rate 0.048, "
            "tool calls 1.000") in buf.getvalue()


# --- copc train end to end --------------------------------------------------------------------

def test_train_writes_records_and_paired_delta(tmp_path):
    from trainer.app.run import run_experiment

    out = tmp_path / "run"
    over = {"preset": "copc", "output_dir": str(out), "model.tiny.hidden_size": "32",
            "model.tiny.intermediate_size": "64", "model.tiny.num_layers": "1", "task.env": "math_tool",
            "task.train_data": "[math_train]", "task.max_train_samples": "8",
            "task.env_kwargs": "{prompt_template: 'Q: {problem}\n'}", "train.total_steps": "1",
            "train.prompts_per_step": "2", "train.micro_batch_size": "4", "rollout.max_new_tokens": "8",
            "rollout.max_turns": "1", "rollout.max_total_tokens": "512", "rollout.concurrency": "4",
            "eval.enabled": "true", "eval.num_samples": "5", "warm_start.enabled": "false",
            "logging.progress": "false", "logging.plots": "false"}
    summary = run_experiment(load_config(None, [f"{k}={v}" for k, v in over.items()]))
    for name, phase in (("before_rl", "eval_before"), ("after_rl", "eval_after")):
        rows = read_records(out / "eval" / f"{name}.jsonl")
        assert len(rows) == 5 and [r["sample_index"] for r in rows] == list(range(5))
        assert sum(r["correct"] for r in rows) / 5 == pytest.approx(summary[phase]["accuracy"])
        lo, hi = summary[phase]["accuracy_ci95_low"], summary[phase]["accuracy_ci95_high"]
        assert (lo, hi) == pytest.approx(wilson_interval(summary[phase]["accuracy"], 5))
    delta = summary["eval_delta"]
    assert delta["metric"] == "accuracy" and delta["n"] == 5
    change = summary["eval_after"]["accuracy"] - summary["eval_before"]["accuracy"]
    assert delta["mean"] == pytest.approx(change)
    assert json.loads((Path(out) / "summary.json").read_text())["eval_delta"] == delta
    tail = summary["train_tail"]  # one RL step: the last 20 % is that step
    step1 = [r for r in read_metrics(out) if r.get("step") == 1 and "rollout/reward_mean" in r][-1]
    assert tail["steps"] == [1, 1]
    assert tail["rollout/reward_mean"] == pytest.approx(step1["rollout/reward_mean"])


def test_report_row_labels_survive_an_80_column_terminal():
    """Issue 21 item 18: at 80 columns (``make main | cat``) every row label and every value is
    printed whole, and no line is wider than the terminal."""
    labels = ["accuracy", "em", "infra_failed", "invalid_action_rate", "mean_response_tokens",
              "mean_reward", "mean_tool_calls", "mean_turns", "n", "tool_call_rate"]
    before = {k: 0.25 for k in labels} | {"accuracy_ci95_low": 0.0320180, "accuracy_ci95_high": 0.0799915,
                                          "em_ci95_low": 0.125, "em_ci95_high": 0.5, "accuracy": 17 / 334}
    after = {k: 0.5 for k in labels} | {"accuracy_ci95_low": 0.055, "accuracy_ci95_high": 0.114,
                                        "accuracy": 0.08}
    delta = {"metric": "accuracy", "mean": 0.029, "ci95_low": 0.006, "ci95_high": 0.054, "n": 334}
    buf = io.StringIO()
    print_report({"name": "tiny_run", "preset": "copc", "task": "math_tool", "warm_start": True,
                  "eval_before": before, "eval_after": after, "eval_delta": delta, "steps": 3},
                 console=Console(file=buf, width=80, color_system=None))
    text = buf.getvalue()
    lines = text.splitlines()
    assert max(len(line) for line in lines) <= 80
    cells = [[c.strip() for c in line.split("│")[1:-1]] for line in lines if line.count("│") >= 3]
    first = [c[0] for c in cells if c and c[0]]
    for k in labels:
        assert k in first, (k, text)
    flat = " ".join(" ".join(c) for c in cells)
    for part in ("0.051", "[0.032,", "0.080]", "[0.055,", "0.114]", "+0.029", "[+0.006,", "+0.054]",
                 "(n=334)"):
        assert part in flat, (part, text)


def test_a_long_metric_label_folds_and_leaves_the_values_readable_at_80_columns():
    """A reviewer's finding: a 75-character label took every column's room (values squeezed to
    nothing); now it folds over lines (all its characters kept) and every value is printed."""
    long = "reward_components/correct_answer_with_tool_bonus_and_format_penalty_mean"
    before, after = {long: 0.125, "em": 0.25}, {long: 0.375, "em": 0.5}
    buf = io.StringIO()
    print_report({"name": "a_run_with_a_long_name", "preset": "copc", "task": "math_tool",
                  "eval_before": before, "eval_after": after, "steps": 3},
                 console=Console(file=buf, width=80, color_system=None))
    text = buf.getvalue()
    lines = text.splitlines()
    assert max(len(line) for line in lines) <= 80
    cells = [[c.strip() for c in line.split("│")[1:-1]] for line in lines if line.count("│") >= 3]
    assert long in "".join(c[0] for c in cells if c), text  # folded, every character kept
    flat = " ".join(" ".join(c) for c in cells)
    for part in ("0.125", "0.375", "0.250", "0.500"):
        assert part in flat, (part, text)
