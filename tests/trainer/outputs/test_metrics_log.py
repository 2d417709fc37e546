"""MetricsLogger (JSONL + TensorBoard, resume truncation), write_summary, make_plots."""

from __future__ import annotations

import json
import math
import time

import matplotlib.image as mpimg
import numpy as np
import pytest
import torch

from trainer.outputs.metrics_log import MetricsLogger, last_steps_mean, read_metrics, write_summary
from trainer.outputs.plots import make_plots

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _tb_scalars(logdir, tag):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(logdir))
    acc.Reload()
    return [(e.step, e.value) for e in acc.Scalars(tag)]


def test_log_and_read(tmp_path):
    t0 = time.time()
    with MetricsLogger(tmp_path, tensorboard=False) as ml:
        ml.log(
            0,
            {
                "rollout/reward_mean": 0.5,
                "n": np.int64(3),
                "f32": np.float32(0.25),
                "t": torch.tensor(1.5),
                "flag": True,
                "staleness/hist": [4, 2, 0, 1],
            },
        )
        ml.log(2, {"rollout/reward_mean": float("nan"), "x": float("inf")})
        recs = ml.read()
    t1 = time.time()
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 2
    assert [r["step"] for r in recs] == [0, 2]
    assert t0 <= recs[0]["time"] <= recs[1]["time"] <= t1
    first = {k: v for k, v in recs[0].items() if k != "time"}
    assert first == {
        "step": 0,
        "rollout/reward_mean": 0.5,
        "n": 3,
        "f32": 0.25,
        "t": 1.5,
        "flag": 1,
        "staleness/hist": [4, 2, 0, 1],
    }
    assert isinstance(first["n"], int)
    assert math.isnan(recs[1]["rollout/reward_mean"]) and recs[1]["x"] == math.inf
    assert read_metrics(tmp_path) == recs
    assert not (tmp_path / "tensorboard").exists()


def test_bad_input_names_the_field(tmp_path):
    with MetricsLogger(tmp_path, tensorboard=False) as ml:
        ml.log(1, {"a": 1.0})
        with pytest.raises(ValueError, match="not after the last logged step 1"):
            ml.log(1, {"a": 2.0})
        with pytest.raises(ValueError, match="step must be"):
            ml.log(-3, {})
        with pytest.raises(ValueError, match="'time'"):
            ml.log(2, {"time": 1.0})
        with pytest.raises(ValueError, match=r"metric 'bad'.*str"):
            ml.log(2, {"bad": "hello"})
        with pytest.raises(ValueError, match=r"metric 'h'\[1\]"):
            ml.log(2, {"h": [1, None]})
        with pytest.raises(ValueError, match="metric 'vec'"):
            ml.log(2, {"vec": torch.ones(2, 2)})
        assert [r["step"] for r in ml.read()] == [1]  # rejected calls wrote nothing


def test_truncate_after_and_resume(tmp_path):
    with MetricsLogger(tmp_path, tensorboard=True) as ml:
        for s in range(1, 6):
            ml.log(s, {"loss": float(s)})
    # the crashed run's checkpoint was at step 3; resume drops steps 4, 5 and logs them again
    with MetricsLogger(tmp_path, tensorboard=True, resume=True) as ml:
        assert [r["step"] for r in ml.read()] == [1, 2, 3, 4, 5]
        ml.truncate_after(3)
        assert [r["step"] for r in ml.read()] == [1, 2, 3]
        with pytest.raises(ValueError, match="not after"):
            ml.log(3, {"loss": 0.0})
        for s in (4, 5, 6):
            ml.log(s, {"loss": 10.0 * s})
    recs = read_metrics(tmp_path)
    assert [(r["step"], r["loss"]) for r in recs] == [
        (1, 1.0),
        (2, 2.0),
        (3, 3.0),
        (4, 40.0),
        (5, 50.0),
        (6, 60.0),
    ]
    # TensorBoard readers see the purge too: no duplicated steps 4, 5
    assert _tb_scalars(tmp_path / "tensorboard", "loss") == [
        (1, 1.0),
        (2, 2.0),
        (3, 3.0),
        (4, 40.0),
        (5, 50.0),
        (6, 60.0),
    ]


def test_purge_holds_when_the_writer_counter_crosses_a_power_of_ten(tmp_path):
    """Event files opened in one second sort by tensorboard's per-process counter as text
    (``.10`` before ``.9``); the purge must still apply to the older file (a CI failure)."""
    from tensorboard.summary.writer import event_file_writer

    while event_file_writer._global_uid.get() % 10 != 8:  # the next two files: ...9, ...10
        pass
    test_truncate_after_and_resume(tmp_path)


def test_resume_drops_torn_last_line(tmp_path):
    with MetricsLogger(tmp_path, tensorboard=False) as ml:
        ml.log(1, {"a": 1.0})
        ml.log(2, {"a": 2.0})
    with open(tmp_path / "metrics.jsonl", "a") as f:  # a write cut by SIGKILL
        f.write('{"step": 3, "time": 1.0, "a": 3.')
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2]
    with MetricsLogger(tmp_path, tensorboard=False, resume=True) as ml:
        ml.log(3, {"a": 33.0})
    assert (tmp_path / "metrics.jsonl").read_text().count("\n") == 3
    assert [r["a"] for r in read_metrics(tmp_path)] == [1.0, 2.0, 33.0]


def test_corrupt_middle_line_is_an_error(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\nnot json\n{"step": 3}\n')
    with pytest.raises(ValueError, match=r"metrics.jsonl:2"):
        read_metrics(tmp_path)


def test_fresh_run_moves_old_metrics_aside(tmp_path):
    with MetricsLogger(tmp_path, tensorboard=False) as ml:
        ml.log(1, {"a": 1.0})
    with MetricsLogger(tmp_path, tensorboard=False) as ml:
        assert ml.read() == []
        ml.log(1, {"a": 5.0})
    old = list(tmp_path.glob("metrics.*.jsonl.old"))
    assert len(old) == 1
    assert json.loads(old[0].read_text())["a"] == 1.0
    assert read_metrics(tmp_path)[0]["a"] == 5.0


def test_write_summary_atomic(tmp_path):
    p = write_summary(
        tmp_path / "run",
        {
            "accuracy": {"warm_start": 0.25, "rl": np.float64(0.5)},
            "steps": np.int64(20),
            "out": tmp_path,
            "curve": np.arange(3),
        },
    )
    assert p == tmp_path / "run" / "summary.json"
    assert json.loads(p.read_text()) == {
        "accuracy": {"warm_start": 0.25, "rl": 0.5},
        "steps": 20,
        "out": str(tmp_path),
        "curve": [0, 1, 2],
    }
    before = p.read_text()
    with pytest.raises(TypeError, match=r"summary\['bad'\]\['obj'\]"):
        write_summary(tmp_path / "run", {"bad": {"obj": object()}})
    assert p.read_text() == before  # a failed write leaves the previous summary intact
    write_summary(tmp_path / "run", {"x": 1})
    assert json.loads(p.read_text()) == {"x": 1}
    assert sorted(q.name for q in (tmp_path / "run").iterdir()) == ["summary.json"]  # no temp files left


def _synthetic_history(n: int = 30) -> list[dict]:
    rng = np.random.default_rng(0)
    recs = []
    for s in range(1, n + 1):
        hist = [int(c) for c in rng.integers(0, 5, size=4)]
        r = {
            "step": s,
            "time": 1000.0 + s,
            "rollout/reward_mean": 0.2 + 0.02 * s + 0.05 * float(rng.standard_normal()),
            "staleness/hist": hist,
            "staleness/mean": float(np.dot(hist, range(4)) / max(1, sum(hist))),
            "staleness/max": max((i for i, c in enumerate(hist) if c), default=0),
            "actor/dis_masked_frac": 0.1 * float(rng.random()),
            "advantage/clipped_frac": 0.05 * float(rng.random()),
            "actor/ratio_mean": 1.0,
            "actor/ratio_max": 1.5 + float(rng.random()),
            "actor/ratio_min": 0.5 * float(rng.random()) + 0.1,
            "critic/value_loss": 1.0 / s,
            "rollout/tool_calls": 1.0 + 0.01 * s,
            "rollout/invalid_action_rate": 0.3 / s,
        }
        if s % 10 == 0:
            r["eval/accuracy"] = 0.1 * s / 10
        recs.append(r)
    return recs


def _check_png(path) -> np.ndarray:
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC and len(data) > 5000
    img = mpimg.imread(path)
    assert img.ndim == 3 and img.shape[0] >= 300 and img.shape[1] >= 500
    assert img[..., :3].std() > 0.02  # not a blank canvas
    return img


def test_make_plots_all(tmp_path):
    metrics = _synthetic_history()
    paths = make_plots(metrics, tmp_path / "plots")
    assert [p.name for p in paths] == [
        "reward_accuracy.png",
        "staleness.png",
        "masked_fraction.png",
        "ratio.png",
        "value_loss.png",
        "tool_calls.png",
    ]
    for p in paths:
        _check_png(p)
    assert sorted(q.name for q in (tmp_path / "plots").iterdir()) == sorted(p.name for p in paths)


def test_make_plots_skips_missing_keys(tmp_path):
    assert make_plots([], tmp_path / "empty") == []
    only_value = [{"step": s, "critic/value_loss": 1.0 / s} for s in range(1, 6)]
    assert [p.name for p in make_plots(only_value, tmp_path / "v")] == ["value_loss.png"]
    # staleness from per-step mean/max when there is no histogram; NaN values do not break plotting
    stale = [
        {
            "step": s,
            "staleness/mean": s % 3 / 2,
            "staleness/max": s % 3,
            "actor/ratio_max": float("nan") if s == 2 else 2.0,
        }
        for s in range(1, 8)
    ]
    paths = make_plots(stale, tmp_path / "s")
    assert [p.name for p in paths] == ["staleness.png", "ratio.png"]
    for p in paths:
        _check_png(p)
    with pytest.raises(ValueError, match=r"metrics\[1\]"):
        make_plots([{"step": 1}, {"x": 1.0}], tmp_path / "bad")


def test_plots_from_logger_records(tmp_path):
    """The logger's records feed make_plots directly (the end-of-run path)."""
    with MetricsLogger(tmp_path, tensorboard=False) as ml:
        for r in _synthetic_history(12):
            ml.log(r["step"], {k: v for k, v in r.items() if k not in ("step", "time")})
        recs = ml.read()
    assert len(make_plots(recs, tmp_path)) == 6


def test_last_steps_mean_by_hand():
    """24 steps, frac 0.2: ceil(4.8) = 5 steps (20–24); evaluation records, masked-out garbage in
    other keys and a re-done step (resume: its last record counts) change nothing else."""
    recs = [{"step": 0, "eval/invalid_action_rate": 9.0, "rollout/invalid_action_rate": 9.0}]
    recs += [{"step": s, "rollout/invalid_action_rate": 0.01 * s, "other": "garbage"} for s in range(1, 25)]
    recs += [{"step": 22, "rollout/invalid_action_rate": 0.5}, {"step": 25, "eval/em": 0.1}]
    got = last_steps_mean(recs, keys=("rollout/invalid_action_rate", "rollout/missing"), frac=0.2)
    assert got["steps"] == [20, 24] and got["frac"] == 0.2 and "rollout/missing" not in got
    assert got["rollout/invalid_action_rate"] == pytest.approx((0.20 + 0.21 + 0.5 + 0.23 + 0.24) / 5)
    # 3 steps: ceil(0.6) = 1 step; frac 1: every step
    three = [{"step": s, "rollout/tool_calls": float(s)} for s in (1, 2, 3)]
    assert last_steps_mean(three, ("rollout/tool_calls",))["rollout/tool_calls"] == 3.0
    assert last_steps_mean(three, ("rollout/tool_calls",), frac=1.0)["rollout/tool_calls"] == 2.0
    assert last_steps_mean([{"step": 0, "eval/em": 0.1}]) == {}
    with pytest.raises(ValueError, match="frac=0"):
        last_steps_mean(three, frac=0)
