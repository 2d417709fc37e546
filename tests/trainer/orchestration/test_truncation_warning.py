"""A warning when a response cap truncates most episodes (issue 45, item 4): real runs of the tiny
model through ``copc train``'s own entry (:func:`trainer.app.run.run_experiment`) against the real
math sandbox, one whose ``rollout.max_new_tokens=2`` cuts every turn and one whose turns end on
stop strings before the cap."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from trainer.app.run import run_experiment
from trainer.config import load_config

ROOT = Path(__file__).resolve().parents[3]
pytestmark = pytest.mark.usefixtures("one_torch_thread")

#: Printable bytes as stop strings: the untrained byte-level model ends almost every turn on one of
#: them long before 64 tokens (each is ~1/258 of a token's probability mass).
STOPS = list("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789 .,;:!?()[]{}<>=+-*/")


def _run(tmp_path: Path, name: str, caplog, *overrides: str) -> tuple[list[dict], list[str]]:
    """Two RL steps of the tiny math job (no warm-start, no evaluation); the metrics rows and the
    truncation warnings logged."""
    cfg = load_config(ROOT / "configs" / "math_tool" / "cpu_tiny.yaml", [
        f"output_dir={tmp_path / name}", "warm_start.enabled=false", "eval.enabled=false",
        "train.total_steps=2", "train.prompts_per_step=4", "logging.progress=false", "logging.plots=false",
        "checkpoint.every_steps=2", *overrides])
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="trainer.orchestration.truncation"):
        run_experiment(cfg)
    rows = [json.loads(x) for x in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "rollout/truncated_fraction" in r]
    return rows, [r.getMessage() for r in caplog.records if r.name == "trainer.orchestration.truncation"]


def test_a_cap_that_cuts_every_turn_is_warned_once_and_measured(tmp_path, caplog):
    rows, warnings = _run(tmp_path, "capped", caplog, "rollout.max_new_tokens=2")
    assert len(rows) == 2
    assert [r["rollout/truncated_fraction"] for r in rows] == [1.0, 1.0]
    assert [r["rollout/max_new_tokens_cut_fraction"] for r in rows] == [1.0, 1.0]
    assert len(warnings) == 1  # step 1; step 2 is within the next 10 steps
    assert warnings[0] == ("step 1: 100% of the episodes were truncated by a token cap (100% by "
                           "rollout.max_new_tokens=2); the policy trains on cut-off responses: raise "
                           "rollout.max_new_tokens (next warning in 10 steps at the earliest; metric "
                           "rollout/truncated_fraction)")


def test_turns_that_end_before_the_cap_give_no_warning(tmp_path, caplog):
    stops = "[" + ",".join(json.dumps(s) for s in STOPS) + "]"
    rows, warnings = _run(tmp_path, "free", caplog, "rollout.max_new_tokens=64", f"rollout.stop={stops}")
    assert len(rows) == 2
    assert all(r["rollout/truncated_fraction"] < 0.5 for r in rows), rows
    assert warnings == []
