"""``copc sweep``: grid parsing, validation before any run, real tiny sweeps end to end, resume,
failures, and heatmap annotations equal to the CSV aggregates."""

from __future__ import annotations

import csv
import dataclasses
import json
import math
import os
import shutil
from pathlib import Path

import pytest

from trainer.cli import build_parser, main
from trainer.errors import ConfigError
from trainer.sweep.collect import aggregate, collect, mean_sd, write_csv
from trainer.sweep.command import spec_from_args
from trainer.sweep.grid import Grid, format_value, load_spec, parse_grid_arg, parse_seeds, parse_value
from trainer.sweep.plan import build_plan
from trainer.sweep.plots import cell_text, heatmap_axes, plot_heatmaps

REPO = Path(__file__).parent.resolve().parents[2]
TINY = str(REPO / "configs/math_tool/cpu_tiny.yaml")
#: The channel strengths' config keys: η_P of the dis loss, η_A of the copc estimator (their settings).
ETA_P, ETA_A = "algorithm.policy_loss_settings.eta_p", "algorithm.estimator_settings.eta_a"
#: The cheapest real run: a 1-layer 32-wide model, one warm-start step, 2 RL steps of 2 prompts,
#: 2 evaluation problems; a checkpoint every step (so step 1 can be evaluated post hoc).
CHEAP = ["train.total_steps=2", "train.prompts_per_step=2", "train.micro_batch_size=2",
         "train.critic_warmup_steps=0", "warm_start.steps=1", "warm_start.num_examples=4",
         "warm_start.batch_size=2", "eval.num_samples=2", "eval.k=1", "logging.tensorboard=false",
         "logging.plots=false", "checkpoint.every_steps=1", "model.tiny.hidden_size=32",
         "model.tiny.intermediate_size=64", "model.tiny.num_layers=1", "rollout.max_new_tokens=12"]


@pytest.fixture(autouse=True)
def _one_thread(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # the runs are subprocesses: they inherit it


def _csv(path: Path) -> list[dict]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


# ------------------------------------------------------------------------------------- parsing
def test_grid_values_are_typed_like_train_overrides():
    assert parse_grid_arg("algorithm.eta_p=0.25,0.5,0.75") == ("algorithm.eta_p", [0.25, 0.5, 0.75])
    key, lags = parse_grid_arg("train.fixed_lag=8, 12,16")
    assert key == "train.fixed_lag" and lags == [8, 12, 16] and all(type(v) is int for v in lags)
    _, flags = parse_grid_arg("logging.plots=true,false")
    assert flags == [True, False] and all(type(v) is bool for v in flags)
    assert parse_grid_arg("preset=copc,ppo_async") == ("preset", ["copc", "ppo_async"])
    assert parse_grid_arg("train.actor_lr=1e-4,3e-4")[1] == [1e-4, 3e-4]
    # a string YAML would read as another type is quoted when written back, so it stays a string
    assert parse_value("k", "'1'") == "1" and format_value("1") == "'1'" and format_value("true") == "'true'"
    for v in (0.25, 8, True, "fixed", "1", 1e-5, -3):
        back = parse_value("k", format_value(v))
        assert back == v and type(back) is type(v)


@pytest.mark.parametrize("token,needle", [
    ("algorithm.eta_p", "--grid 'algorithm.eta_p': expected key=v1,v2"),
    ("algorithm.eta_p=0.25,,0.5", "--grid algorithm.eta_p: empty value at position 2 in '0.25,,0.5'"),
    ("algorithm.eta_p=", "--grid algorithm.eta_p: empty value at position 1"),
    ("algorithm.eta_p=0.5,0.50", "--grid algorithm.eta_p: duplicate value 0.5 ('0.5' and '0.50')"),
    ("train.fixed_lag=8,[1", "--grid train.fixed_lag: value '[1' is not a valid YAML scalar"),
    ("train.fixed_lag=8,null", "--grid train.fixed_lag: value 'null' must be a scalar"),
    ("algorithm.eta_p=.inf", "--grid algorithm.eta_p: value '.inf' is not finite"),
    ("train.seed=1,2", "--grid train.seed: set by the sweep itself (use --seeds)"),
    ("output_dir=a,b", "--grid output_dir: set by the sweep itself"),
    ("eta p=1", "--grid 'eta p': not a dotted config key"),
])
def test_grid_errors_name_the_bad_token(token, needle):
    with pytest.raises(ConfigError) as e:
        parse_grid_arg(token)
    assert needle in str(e.value)


def test_seeds_parse_and_errors():
    assert parse_seeds("0, 1,2") == [0, 1, 2] and parse_seeds([3, 1]) == [3, 1]
    for bad, needle in (("0,x", "'x' is not an int >= 0"), ("1,1", "duplicate seed 1"), ("-1", "'-1'"),
                        ("", "'' is not an int")):
        with pytest.raises(ConfigError, match=needle):
            parse_seeds(bad)


def test_cartesian_product_order_and_readable_ids():
    g = Grid()
    g.add("algorithm.eta_p", [0.25, 0.5])
    g.add("algorithm.eta_a", [0.5])
    g.add("train.fixed_lag", [8, 12])
    cells = g.cells()
    assert [c.id for c in cells] == ["eta_p0.25_eta_a0.5_fixed_lag8", "eta_p0.25_eta_a0.5_fixed_lag12",
                                     "eta_p0.5_eta_a0.5_fixed_lag8", "eta_p0.5_eta_a0.5_fixed_lag12"]
    assert cells[1].overrides() == ["algorithm.eta_p=0.25", "algorithm.eta_a=0.5", "train.fixed_lag=12"]
    # keys with the same last component keep enough of their path to differ
    g2 = Grid()
    g2.add("warm_start.seed", [1])
    g2.add("model.tiny.seed", [2])
    assert g2.cells()[0].id == "warm_start.seed1_tiny.seed2"
    with pytest.raises(ConfigError, match="no grid"):
        Grid().cells()


def test_heatmap_axes_defaults_and_errors():
    keys = ["algorithm.eta_p", "algorithm.eta_a", "train.fixed_lag"]
    assert heatmap_axes(keys) == ("algorithm.eta_a", "algorithm.eta_p", "train.fixed_lag", [])
    assert heatmap_axes(keys, panel_key="algorithm.eta_p") == \
        ("train.fixed_lag", "algorithm.eta_a", "algorithm.eta_p", [])
    assert heatmap_axes(["a"]) == ("a", None, None, [])
    assert heatmap_axes(["a", "b", "c", "d"]) == ("b", "a", "c", ["d"])
    with pytest.raises(ConfigError, match="--panel-key 'x': not a grid key"):
        heatmap_axes(keys, panel_key="x")


def test_spec_file_with_cli_flags_on_top(tmp_path):
    spec_file = tmp_path / "s.yaml"
    spec_file.write_text(f"config: {TINY}\ngrid:\n  {ETA_P}: [0.25, 0.75]\n  {ETA_A}: [0.5]\n"
                         "seeds: [0, 1]\noverrides: {train.total_steps: 3}\nmetric: accuracy\n")
    args = build_parser(["sweep"]).parse_args(["sweep", "--spec", str(spec_file), "--grid",
                                                f"{ETA_A}=0.25,0.75", "--seeds", "5",
                                                "--parallel", "2", "eval.k=2"])
    spec = spec_from_args(args)
    assert spec.grid.axes == {ETA_P: [0.25, 0.75], ETA_A: [0.25, 0.75]}
    assert spec.seeds == [5] and spec.parallel == 2 and spec.overrides == ["train.total_steps=3", "eval.k=2"]
    plan = build_plan(spec)
    assert len(plan.runs) == 4 and plan.metric == "accuracy"
    assert plan.runs[0].run_dir == Path(f"runs/sweeps/{plan.base.name}").resolve() / \
        "cells/eta_p0.25_eta_a0.25/seed5"
    spec_file.write_text("config: x.yaml\ngrid: {a: 1}\n")
    with pytest.raises(ConfigError, match=r"grid\.a must be a list of values, got 1"):
        load_spec(spec_file)
    spec_file.write_text("config: x.yaml\ngrid: {a: [1]}\nseed: 3\n")
    with pytest.raises(ConfigError, match=r"unknown field\(s\) \['seed'\]"):
        load_spec(spec_file)


def test_shipped_sweep_specs_validate(tmp_path):
    spec = load_spec(REPO / "configs/sweeps/cpu_tiny.yaml")
    spec = dataclasses.replace(spec, out=str(tmp_path / "grid"))  # not the spec's (maybe used) runs/ dir
    tiny = build_plan(spec)
    assert len(tiny.cells) == 8 and len(tiny.runs) == 8
    assert all(r.total_steps == tiny.runs[0].total_steps for r in tiny.runs)
    arms = build_plan(dataclasses.replace(load_spec(REPO / "configs/sweeps/staleness_arms.yaml"),
                                          out=str(tmp_path / "arms")))  # issue 46's experiment
    assert len(arms.cells) == 12 and len(arms.runs) == 60
    assert {r.total_steps for r in arms.runs} == {80}  # > 64: the lag-64 runs reach staleness 64
    run = next(r for r in arms.runs if r.cell.id == "presetcopc_wo_rc_lag64")
    assert {"train.staleness.mode=fixed", "preset=copc_wo_rc", "train.staleness.lag=64"} <= set(run.overrides)
    eta = load_spec(REPO / "configs/sweeps/eta_grid.yaml")  # its Figure-1 grid at lag 16 and 64
    assert eta.grid.axes == {ETA_P: [0.25, 0.5, 1.0], ETA_A: [0.0, 0.25, 0.5, 1.0],
                             "train.staleness.lag": [16, 64]}
    assert len(build_plan(dataclasses.replace(eta, out=str(tmp_path / "eta"))).runs) == 72
    paper = load_spec(REPO / "configs/sweeps/figure1_paper.yaml")
    assert paper.grid.axes == {ETA_P: [0.25, 0.5, 0.75], ETA_A: [0.25, 0.5, 0.75],
                               "train.staleness.lag": [8, 12, 16]}
    with pytest.raises(ConfigError, match=r"model\.path"):  # the paper's model must be filled in
        build_plan(paper)
    (tmp_path / "model").mkdir()
    paper.overrides.append(f"model.path={tmp_path / 'model'}")
    plan = build_plan(paper)
    assert len(plan.runs) == 27 and plan.metric == "avg@32"
    run = next(r for r in plan.runs if r.cell.id == "eta_p0.25_eta_a0.75_lag16")
    assert {"train.staleness.mode=fixed", f"{ETA_P}=0.25", f"{ETA_A}=0.75",
            "train.staleness.lag=16"} <= set(run.overrides)


def test_the_real_model_arm_spec_validates(realmodel_path, tmp_path):
    """configs/sweeps/search_real_arms.yaml (issue 46's real-model arm): 3 presets x lag 16 x 2 seeds
    of the real search job, 32 steps (16 at staleness 16), fixed lag, EM."""
    spec = load_spec(REPO / "configs/sweeps/search_real_arms.yaml")
    plan = build_plan(dataclasses.replace(spec, out=str(tmp_path / "real")))
    assert len(plan.runs) == 6 and plan.metric == "em" and {r.total_steps for r in plan.runs} == {32}
    run = next(r for r in plan.runs if r.cell.id == "presetppo_async_lag16")
    assert {"train.staleness.mode=fixed", "preset=ppo_async", "train.staleness.lag=16"} <= set(run.overrides)


# ----------------------------------------------------------------------- validation up front
@pytest.mark.parametrize("grid,needle", [
    (f"{ETA_A}=0.25,2", f"cell eta_a2 (seed 0): {ETA_A}=2.0: must be a number in [0, 1]"),
    ("train.bogus=1,2", "cell bogus1 (seed 0): train.bogus: Key 'bogus' not in 'TrainConfig'"),
    ("rollout.top_k=-1,abc", "cell top_kabc (seed 0): rollout.top_k"),
])
def test_bad_grid_value_exits_2_before_any_run(tmp_path, capsys, grid, needle):
    out = tmp_path / "sweep"
    rc = main(["sweep", "--config", TINY, "--grid", grid, "--out", str(out), *CHEAP])
    err = capsys.readouterr().err
    assert rc == 2 and needle in err, err
    assert not out.exists()  # nothing started, nothing written


def test_other_up_front_errors_exit_2(tmp_path, capsys):
    cases = [(["--grid", f"{ETA_A}=0.5", "train.total_steps=2", f"{ETA_A}=0.25"],
              f"override '{ETA_A}=0.25': algorithm.estimator_settings.eta_a is also a grid key"),
             (["--grid", "algorithm.estimator_settings.eta_a=0.5", "--metric", "acc"], "--metric 'acc'"),
             (["--grid", f"{ETA_A}=0.5", "--panel-key", "x"], "--panel-key 'x': not a grid key"),
             (["--grid", f"{ETA_A}=0.5", "eval.enabled=false"], "eval.enabled=False"),
             (["--grid", "algorithm.estimator_settings.eta_a=0.5", "--parallel", "0"], "--parallel=0")]
    for extra, needle in cases:
        rc = main(["sweep", "--config", TINY, "--out", str(tmp_path / "s"), *extra])
        err = capsys.readouterr().err
        assert rc == 2 and needle in err, (extra, err)
    assert not (tmp_path / "s").exists()


def test_fixed_lag_axis_without_fixed_mode_exits_2(tmp_path, capsys):
    """Regression: ``--grid train.staleness.lag=0,2`` without ``train.staleness.mode=fixed`` used to run
    identical bounded cells (the lag is ignored when bounded) and draw a meaningless heatmap."""
    out = tmp_path / "s"
    bounded = tmp_path / "bounded.yaml"  # the main job's config switched back to a staleness bound
    bounded.write_text(f"defaults: [{TINY}]\ntrain: {{staleness: {{mode: bounded, max: 8}}}}\n")
    rc = main(["sweep", "--config", str(bounded), "--out", str(out), "--grid", "train.staleness.lag=0,2",
               "--dry-run"])
    err = capsys.readouterr().err
    assert rc == 2 and "cell lag0 (seed 0): train.staleness.lag=0: not a setting of " \
        "train.staleness.mode='bounded' (its settings: max)" in err, err
    rc = main(["sweep", "--config", TINY, "--out", str(out), "--grid", "train.staleness.lag=0,2", "--dry-run",
               "train.staleness.mode=fixed"])
    assert rc == 0
    plan = build_plan(spec_from_args(build_parser(["sweep"]).parse_args(
        ["sweep", "--config", TINY, "--out", str(out), "--grid", "train.staleness.lag=0,2",
         "train.staleness.mode=fixed"])))
    assert [load_lag(r) for r in plan.runs] == [0, 2]


def load_lag(run) -> int:
    """The fixed lag a planned run trains with (its config loaded as ``copc train`` would)."""
    from trainer.config import load_config
    cfg = load_config(run.config, list(run.overrides))
    assert cfg.staleness.mode == "fixed"
    return cfg.max_staleness


# ------------------------------------------------------------ heatmap numbers == CSV aggregates
def _fake_finished_run(run, final: float, during: float | None = None) -> None:
    """The files a finished ``copc train`` leaves (summary.json, metrics.jsonl), with given metrics."""
    run.run_dir.mkdir(parents=True)
    steps = run.total_steps
    summary = {"steps": steps, "wall_s": 1.5, "eval_before": {"accuracy": 0.99},
               "eval_after": {"accuracy": final}}
    (run.run_dir / "summary.json").write_text(json.dumps(summary))
    recs = [{"step": 0, "time": 0.0, "eval/accuracy": 0.99}]  # before RL: never counted as best
    recs += [{"step": s, "time": 0.0, "rollout/reward_mean": 0.1 * s} for s in range(1, steps + 1)]
    if during is not None:
        recs[1]["eval/accuracy"] = during
    recs.append({"step": steps + 1, "time": 0.0, "eval/accuracy": final})
    (run.run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))


def test_heatmap_annotations_equal_the_csv_aggregates(tmp_path):
    args = build_parser(["sweep"]).parse_args(
        ["sweep", "--config", TINY, "--out", str(tmp_path), "--seeds", "0,1",
         "--grid", f"{ETA_P}=0.25,0.75", "--grid", f"{ETA_A}=0.25,0.75",
         "--grid", "train.staleness.lag=0,2", "train.staleness.mode=fixed", "train.total_steps=3"])
    plan = build_plan(spec_from_args(args))
    assert len(plan.runs) == 16
    finals = {}
    for i, run in enumerate(plan.runs):
        if run.cell.id == "eta_p0.75_eta_a0.75_lag2":
            continue  # a cell that never ran: drawn as n/a
        if run.cell.id == "eta_p0.25_eta_a0.75_lag2" and run.seed == 1:
            run.status_file.parent.mkdir(parents=True, exist_ok=True)
            run.status_file.write_text(json.dumps({"status": "failed", "returncode": 1}))
            continue  # one failed seed: that cell's mean is its one finished seed, sd blank
        finals[(run.cell.id, run.seed)] = 0.05 * i
        _fake_finished_run(run, 0.05 * i, during=0.9 if i == 4 else None)
    rows = collect(plan)
    aggs = aggregate(rows, plan.cells)
    write_csv(aggs, tmp_path / "sweep_cells.csv")
    table = {r["cell"]: r for r in _csv(tmp_path / "sweep_cells.csv")}
    # hand-computed: cell 0 has finals 0.00 and 0.05: mean 0.025, sd = 0.05 / sqrt(2)
    c0 = table["eta_p0.25_eta_a0.25_lag0"]
    assert float(c0["final_mean"]) == pytest.approx(0.025)
    assert float(c0["final_sd"]) == pytest.approx(0.05 / math.sqrt(2))
    # run 4 (cell 2, seed 0) logged 0.9 during RL: best of that cell = mean(0.9, 0.25), final
    # mean(0.2, 0.25); the evaluation before RL (0.99) never counts
    c2 = table["eta_p0.25_eta_a0.75_lag0"]
    assert float(c2["best_mean"]) == pytest.approx(0.575) and float(c2["final_mean"]) == pytest.approx(0.225)
    c3 = table["eta_p0.25_eta_a0.75_lag2"]  # seed 1 failed: seed 0 (run 6) alone
    assert (c3["n_ok"], c3["n_failed"], c3["final_sd"]) == ("1", "1", "nan")
    assert float(c3["final_mean"]) == 0.05 * 6
    assert table["eta_p0.75_eta_a0.75_lag2"]["n_ok"] == "0"
    for value in ("final", "best"):
        notes = plot_heatmaps(aggs, plan.spec.grid, tmp_path, "accuracy", value)
        assert len(notes) == 8 and Path(notes[0].figure).name == f"heatmap_{value}.png"
        assert Path(notes[0].figure).stat().st_size > 5000
        for a in notes:
            row = table[a.cell]
            assert row[ETA_A] == a.x and row[ETA_P] == a.y
            assert row["train.staleness.lag"] == a.panel
            mean, sd = float(row[f"{value}_mean"]), float(row[f"{value}_sd"])
            assert a.text == cell_text(mean, sd)  # the text read back from the figure
            if math.isnan(mean):
                assert a.text == "n/a"
            else:
                nums = [float(t) for t in a.text.replace("±", " ").split()]
                assert nums[0] == round(mean, 3) and (math.isnan(sd) or nums[1] == round(sd, 3))


def test_mean_sd_matches_the_textbook_formula():
    assert mean_sd([1.0, 2.0, 4.0]) == (pytest.approx(7 / 3), pytest.approx(math.sqrt((16 + 1 + 25) / 9 / 2)))
    m, s = mean_sd([0.5])
    assert m == 0.5 and math.isnan(s)
    assert all(math.isnan(v) for v in mean_sd([]))


# -------------------------------------------------------------------------- real tiny sweeps
@pytest.fixture(scope="module")
def tiny_sweep(tmp_path_factory):
    """A real 2-cell sweep (spec file + CLI flags), checkpoints evaluated post hoc."""
    root = tmp_path_factory.mktemp("sweep")
    spec = root / "spec.yaml"
    spec.write_text(f"config: {TINY}\ngrid:\n  algorithm.estimator_settings.eta_a: [0.25, 0.75]\nseeds: [0]\n"
                    f"out: {root / 'out'}\noverrides: [{', '.join(CHEAP)}]\n")
    old = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = "1"
    try:
        rc = main(["sweep", "--spec", str(spec), "--parallel", "2", "--eval-checkpoints"])
    finally:
        if old is None:
            os.environ.pop("OMP_NUM_THREADS")
        else:
            os.environ["OMP_NUM_THREADS"] = old
    return rc, root / "out", spec


def test_two_cell_sweep_end_to_end(tiny_sweep):
    rc, out, _ = tiny_sweep
    assert rc == 0
    rows = _csv(out / "sweep.csv")
    assert [(r["cell"], r["algorithm.estimator_settings.eta_a"], r["seed"], r["status"]) for r in rows] == \
        [("eta_a0.25", "0.25", "0", "ok"), ("eta_a0.75", "0.75", "0", "ok")]
    for r in rows:
        run_dir = out / "cells" / r["cell"] / "seed0"
        summary = json.loads((run_dir / "summary.json").read_text())
        cfg = (run_dir / "config.yaml").read_text()
        assert f"eta_a: {r['algorithm.estimator_settings.eta_a']}" in cfg and f"output_dir: {run_dir}" in cfg
        assert float(r["final"]) == summary["eval_after"]["accuracy"]
        assert int(r["steps"]) == summary["steps"] == 2 and float(r["wall_s"]) == summary["wall_s"]
        # step 1 evaluated post hoc (step 2 is the final evaluation); best = max over both
        step1 = json.loads((run_dir / "posthoc_eval/step_00000001.json").read_text())
        assert set(step1) >= {"accuracy", "avg@1", "mean_reward"}
        assert float(r["best"]) == max(step1["accuracy"], summary["eval_after"]["accuracy"])
        status = json.loads((out / "cells" / r["cell"] / "seed0.status.json").read_text())
        assert status["status"] == "ok" and status["returncode"] == 0 and status["resumed"] is False
        assert "copc sweep" in (out / "cells" / r["cell"] / "seed0.log").read_text()
    agg = _csv(out / "sweep_cells.csv")
    assert [(a["cell"], a["n_ok"], a["final_mean"]) for a in agg] == \
        [(r["cell"], "1", r["final"]) for r in rows]
    for png in ("heatmap_final.png", "heatmap_best.png", "curves.png"):
        assert (out / png).stat().st_size > 5000
    report = (out / "report.md").read_text()
    assert "![heatmap_final](heatmap_final.png)" in report and "| eta_a0.75 | 0.75 | 1 | 0 |" in report
    assert "## Failed or unfinished runs\n\n(none)" in report
    # the cost table: every run logs its step time and throughput per device
    metrics = out / "cells" / "eta_a0.25" / "seed0" / "metrics.jsonl"
    rows2 = [json.loads(x) for x in metrics.read_text().splitlines()]
    step2 = next(r for r in rows2 if r.get("step") == 2 and "perf/step_s" in r)
    assert step2["perf/tokens_per_s_per_device"] == pytest.approx(step2["perf/tokens_per_s"])  # 1 device
    assert step2["perf/step_s"] > 0 and "## Cost (the paper's Table 3)" in report


def test_resume_skips_finished_and_resumes_unfinished(tiny_sweep, tmp_path):
    _, first, spec = tiny_sweep
    out = tmp_path / "out"
    shutil.copytree(first, out)
    done = out / "cells/eta_a0.25/seed0/summary.json"
    stamp = done.stat().st_mtime_ns
    # eta_a0.75 "killed mid-run": no summary, its checkpoints (steps 1 and 2) kept
    (out / "cells/eta_a0.75/seed0/summary.json").unlink()
    shutil.rmtree(out / "cells/eta_a0.75/seed0/checkpoints/step_00000002")
    rc = main(["sweep", "--spec", str(spec), "--out", str(out), "--eval-checkpoints"])
    assert rc == 0
    assert done.stat().st_mtime_ns == stamp  # not re-run
    status = json.loads((out / "cells/eta_a0.75/seed0.status.json").read_text())
    assert status["resumed"] is True and status["command"][-1] == "--resume"
    log = (out / "cells/eta_a0.75/seed0.log").read_text()
    assert log.count("=== copc sweep") >= 3 and "--resume" in log
    summary = json.loads((out / "cells/eta_a0.75/seed0/summary.json").read_text())
    assert summary["steps"] == 2 and "eval_after" in summary
    lines = (out / "cells/eta_a0.75/seed0/metrics.jsonl").read_text().splitlines()
    metrics = [json.loads(line) for line in lines]
    assert [m["step"] for m in metrics if "actor/pg_loss" in m] == [1, 2]  # step 2 re-done once, not twice
    # a third run has nothing to do: no run starts, nothing changes
    again = json.loads((out / "cells/eta_a0.75/seed0/summary.json").read_text())
    assert main(["sweep", "--spec", str(spec), "--out", str(out), "--eval-checkpoints"]) == 0
    assert json.loads((out / "cells/eta_a0.75/seed0/summary.json").read_text()) == again
    assert done.stat().st_mtime_ns == stamp


def test_rerun_with_other_settings_is_refused_not_skipped(tiny_sweep, tmp_path, capsys):
    """Regression: re-running into the same --out with a changed override used to count the old
    runs as done and report their numbers as those of the new settings."""
    _, first, spec = tiny_sweep
    out = tmp_path / "out"
    shutil.copytree(first, out)  # a moved sweep (output_dir, warm_start.cache_dir differ) is fine
    assert main(["sweep", "--spec", str(spec), "--out", str(out), "--eval-checkpoints", "--dry-run"]) == 0
    assert "2 run(s), 2 already done" in capsys.readouterr().out
    rc = main(["sweep", "--spec", str(spec), "--out", str(out), "--eval-checkpoints", "--dry-run",
               "train.actor_lr=0.002"])
    err = capsys.readouterr().err
    assert rc == 2, err
    assert (f"cell eta_a0.25 (seed 0): {out / 'cells/eta_a0.25/seed0'} holds a run with other settings "
            "(train.actor_lr: 0.0001 there, 0.002 now)") in err


def test_failed_run_is_recorded_and_the_sweep_goes_on(tmp_path, capsys):
    out = tmp_path / "out"
    bad = out / "cells/eta_a0.75/seed0"
    bad.parent.mkdir(parents=True)
    bad.write_text("not a directory")  # copc train cannot create its output_dir there: it exits 1
    rc = main(["sweep", "--config", TINY, "--grid", f"{ETA_A}=0.25,0.75", "--out", str(out), *CHEAP])
    assert rc == 1
    rows = {r["cell"]: r for r in _csv(out / "sweep.csv")}
    assert rows["eta_a0.25"]["status"] == "ok" and rows["eta_a0.75"]["status"] == "failed"
    assert rows["eta_a0.75"]["returncode"] == "1" and rows["eta_a0.75"]["final"] == "nan"
    assert rows["eta_a0.75"]["log"] == str(out / "cells/eta_a0.75/seed0.log")
    assert "FileExistsError" in (out / "cells/eta_a0.75/seed0.log").read_text()
    report = (out / "report.md").read_text()
    assert "| eta_a0.75/seed0 | failed | 1 | train |" in report
    assert "eta_a0.75/seed0: failed" in capsys.readouterr().err


@pytest.mark.slow
def test_ray_launcher_runs_each_cell_as_a_ray_task_on_one_cluster(tmp_path):
    out = tmp_path / "out"
    rc = main(["sweep", "--config", TINY, "--grid", f"{ETA_A}=0.25", "--out", str(out),
               "launcher.kind=ray", "launcher.settings.num_cpus=2", *CHEAP])
    assert rc == 0
    status = json.loads((out / "cells/eta_a0.25/seed0.status.json").read_text())
    address = next(o for o in status["command"] if o.startswith("launcher.settings.address="))
    address = address.partition("=")[2].strip("'")
    assert address  # the sweep's cluster, passed to the run ...
    log = (out / "cells/eta_a0.25/seed0.log").read_text()
    assert f"Connecting to existing Ray cluster at address: {address}" in log  # ... which joined it
    assert _csv(out / "sweep.csv")[0]["status"] == "ok"


def test_spec_numbers_parse_as_on_the_command_line(tmp_path):
    """Issue 21 item 16: ``1e-4`` in a spec file is the float the command line gives (YAML 1.1 alone
    reads it as a string): same cell id, same override / CSV text, same run directory."""
    spec_file = tmp_path / "s.yaml"
    spec_file.write_text(f"config: {TINY}\ngrid:\n  {ETA_P}: [1e-4, 2.5E-1]\n"
                         f"seeds: [0]\noverrides: {{train.total_steps: 3, {ETA_A}: 5e-1}}\n")
    parser = build_parser(["sweep"])
    from_spec = build_plan(spec_from_args(parser.parse_args(["sweep", "--spec", str(spec_file)])))
    cli = parser.parse_args(["sweep", "--config", str(TINY), "--grid", f"{ETA_P}=1e-4,2.5E-1",
                             "--seeds", "0", "train.total_steps=3", f"{ETA_A}=5e-1"])
    from_cli = build_plan(spec_from_args(cli))
    assert [r.cell.values for r in from_spec.runs] == [{ETA_P: 1e-4}, {ETA_P: 0.25}]
    assert all(isinstance(r.cell.values[ETA_P], float) for r in from_spec.runs)
    assert [r.cell.id for r in from_spec.runs] == [r.cell.id for r in from_cli.runs]
    assert [r.run_dir for r in from_spec.runs] == [r.run_dir for r in from_cli.runs]
    assert [r.cell.label(ETA_P) for r in from_spec.runs] == ["0.0001", "0.25"]
    eta_a = [p.base.algorithm["estimator_settings"]["eta_a"] for p in (from_spec, from_cli)]
    assert eta_a == [0.5, 0.5]


def test_a_second_sweep_on_the_same_out_is_refused(tmp_path, capsys):
    """Issue 21 item 12 (review): the cells' status files and logs and the sweep's report live in
    ``--out`` outside every run's own lock, so a second ``copc sweep`` on the same ``--out`` (here a
    real second process holds it) exits 2 naming ``--out`` and the holder's pid, running nothing."""
    import subprocess
    import sys

    out = tmp_path / "sweep"
    code = ("import time\nfrom trainer.outputs.lock import lock_output_dir\n"
            f"held = lock_output_dir({str(out)!r})\nprint('held', flush=True)\ntime.sleep(120)")
    holder = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "PYTHONPATH": str(REPO)})
    try:
        assert holder.stdout.readline().strip() == "held"
        rc = main(["sweep", "--config", TINY, "--grid", f"{ETA_A}=0.25", "--out", str(out), *CHEAP])
        assert rc == 2
        err = capsys.readouterr().err.strip().splitlines()[-1]
        assert f"--out={str(out)!r}: another copc process (pid {holder.pid}) is writing there" in err
        assert sorted(p.name for p in out.iterdir()) == [".copc.lock"]
    finally:
        holder.kill()
        holder.wait()


def test_cost_section_is_the_papers_table_3_hand_computed(tmp_path):
    """Fake finished runs of a preset sweep with known step times: per-run median over steps >= 2,
    mean over seeds, speed-up ppo / ppo_async and overhead copc / ppo_async - 1."""
    from trainer.sweep.cost import cost_section

    args = build_parser(["sweep"]).parse_args(
        ["sweep", "--config", TINY, "--out", str(tmp_path), "--seeds", "0,1",
         "--grid", "preset=ppo,ppo_async,copc", "train.total_steps=3"])
    plan = build_plan(spec_from_args(args))
    # step 1 (warm-up) is ignored; steps 2, 3 → median = their mean
    times = {"ppo": (17.0, 17.0), "ppo_async": (10.0, 10.0), "copc": (10.1, 10.3)}
    for run in plan.runs:
        _fake_finished_run(run, 0.5)
        s2, s3 = times[run.cell.values["preset"]]
        s2, s3 = s2 + run.seed, s3 + run.seed  # seeds 0, 1 → cell mean of medians + 0.5
        recs = [{"step": 1, "perf/step_s": 99.0, "perf/tokens_per_s_per_device": 1.0},
                {"step": 2, "perf/step_s": s2, "perf/tokens_per_s_per_device": 100.0 / s2},
                {"step": 3, "perf/step_s": s3, "perf/tokens_per_s_per_device": 100.0 / s3}]
        with (run.run_dir / "metrics.jsonl").open("a") as f:
            f.write("".join(json.dumps(r) + "\n" for r in recs))
    rows = collect(plan)
    assert [r.status for r in rows] == ["ok"] * 6, [(r.cell, r.status) for r in rows]
    lines = cost_section(plan, rows)
    text = "\n".join(lines)
    ppo, asy, cp = 17.5, 10.5, 10.7  # cell means of the per-run medians
    assert f"| presetppo | ppo | {ppo:.3g} ± 0.707 |" in text
    assert f"speed-up over synchronous PPO {ppo / asy:.2f}×" in text
    assert f"overhead over asynchronous PPO {100 * (cp / asy - 1):+.1f} %" in text
    empty = build_plan(spec_from_args(build_parser(["sweep"]).parse_args(
        ["sweep", "--config", TINY, "--out", str(tmp_path / "none"), "--grid", "preset=ppo,copc"])))
    assert cost_section(empty, []) == []
