"""Reward by generating policy version from ``metrics.jsonl`` records: the pooled data (hand-computed)
and the end-of-run plot ``reward_by_version.png`` that draws it."""

from __future__ import annotations

import math

import pytest

from trainer.outputs.by_version import (
    VersionTally,
    eval_by_version,
    parse_version_key,
    pooled_from_metrics,
    version_key,
)
from trainer.outputs.plots import by_version_figure, make_plots


def _row(step: int, **by_version: tuple[float, float, float]) -> dict:
    """A step's record with (reward mean, accuracy, episodes) per version ``v<k>``."""
    rec: dict = {"step": step}
    for name, (rew, acc, n) in by_version.items():
        v = int(name[1:])
        rec.update({version_key("reward", v): rew, version_key("accuracy", v): acc,
                    version_key("episodes", v): n})
    return rec


#: step 1: v0 mean 0.5 of 2 episodes; step 2: v0 1.0 of 1, v1 0.0 of 3; step 3: v1 1.0 of 1.
ROWS = [_row(1, v0=(0.5, 0.5, 2.0)), _row(2, v0=(1.0, 1.0, 1.0), v1=(0.0, 0.0, 3.0)),
        _row(3, v1=(1.0, 1.0, 1.0))]


def test_keys_round_trip_and_bad_names_are_refused():
    assert version_key("reward", 3) == "rollout/reward_by_version/v3"
    assert version_key("episodes", 12, total=True) == "rollout/episodes_by_version_total/v12"
    assert parse_version_key("rollout/accuracy_by_version_total/v7") == ("accuracy", 7, True)
    assert parse_version_key("rollout/reward_mean") is None
    with pytest.raises(ValueError, match="stat must be one of"):
        version_key("tokens", 1)


def test_pooling_weights_each_step_by_its_episode_count():
    pooled = pooled_from_metrics(ROWS)
    assert sorted(pooled) == [0, 1]
    # v0: (0.5·2 + 1.0·1) / 3 = 2/3, not the mean of the steps' means (0.75)
    assert pooled[0].episodes == 3 and pooled[0].reward == pytest.approx(2 / 3)
    assert pooled[0].accuracy == pytest.approx(2 / 3)
    # v1: (0.0·3 + 1.0·1) / 4 = 0.25
    assert pooled[1].episodes == 4 and pooled[1].reward == pytest.approx(0.25)


def test_a_step_logged_twice_counts_once():
    # a resumed run re-did step 3 (its later record wins); unrelated rows are ignored
    rows = [*ROWS, {"step": 3, "rollout/reward_mean": 0.1}, _row(3, v1=(0.0, 0.0, 1.0))]
    pooled = pooled_from_metrics(rows)
    assert pooled[1].episodes == 4 and pooled[1].reward == 0.0
    assert pooled_from_metrics([{"step": 1, "rollout/reward_mean": 0.3}]) == {}
    assert math.isnan(VersionTally().reward)


def test_eval_curves_are_keyed_by_the_evaluated_version():
    rows = [{"step": 2, "eval/accuracy": 0.25, "eval/policy_version": 0.0},
            {"step": 4, "eval/accuracy": 0.5, "eval/policy_version": 2.0},
            {"step": 5, "eval/accuracy": 0.9}]  # no version: not a point
    assert eval_by_version(rows, ["eval/accuracy", "eval/em"]) == {"eval/accuracy": ([0, 2], [0.25, 0.5])}


def test_plot_draws_the_pooled_values_and_the_eval_curve(tmp_path):
    rows = [*ROWS, {"step": 3, "eval/accuracy": 0.75, "eval/policy_version": 3.0}]
    rows[-2]["rollout/reward_mean"] = 0.4  # beside the per-step curve (reward_accuracy.png)
    fig = by_version_figure(rows)
    reward_ax, acc_ax, count_ax = fig.axes
    train = reward_ax.get_lines()[0]
    assert list(train.get_xdata()) == [0, 1]
    assert list(train.get_ydata()) == pytest.approx([2 / 3, 0.25])
    ev = [ln for ln in acc_ax.get_lines() if "eval/accuracy" in ln.get_label()]
    assert len(ev) == 1 and list(ev[0].get_xdata()) == [3] and list(ev[0].get_ydata()) == [0.75]
    assert acc_ax.get_xlabel() == "policy version"
    assert [p.get_height() for p in count_ax.patches] == [3, 4]
    paths = make_plots(rows, tmp_path)
    assert [p.name for p in paths] == ["reward_accuracy.png", "reward_by_version.png"]
    assert (tmp_path / "reward_by_version.png").stat().st_size > 5000


def test_no_plot_without_by_version_or_versioned_eval_keys():
    assert by_version_figure([{"step": 1, "rollout/reward_mean": 0.5, "eval/accuracy": 0.5}]) is None
