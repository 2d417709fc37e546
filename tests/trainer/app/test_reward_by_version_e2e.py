"""``copc train`` on the tiny from-scratch math job at fixed lag 2: every step's row carries the reward
by generating policy version, the versions are the real ones (row ``s`` of ``metrics.jsonl`` is the
update from version ``s − 1`` to ``s``; at lag 2 its episodes come from version ``max(s − 1 − 2, 0)``,
the staleness the row's ``staleness/hist`` shows), the run's totals pool the steps, and the end-of-run
plot draws them with the held-out curve against ``eval/policy_version``."""

from __future__ import annotations

import json

import pytest

from trainer.outputs.by_version import parse_version_key, pooled_from_metrics
from trainer.outputs.plots import by_version_figure


def test_fixed_lag_2_rows_carry_reward_by_generating_version(tmp_path):
    from trainer.cli import main as cli_main

    out = tmp_path / "run"
    rc = cli_main(["train", "--config", "configs/math_tool/cpu_tiny.yaml", "train.total_steps=5",
                   "train.prompts_per_step=4", "train.micro_batch_size=4", "rollout.max_new_tokens=24",
                   "train.staleness={mode: fixed, lag: 2}", "eval.every_steps=2", "eval.num_samples=2",
                   "eval.k=1", "warm_start.enabled=false", "logging.progress=false", f"output_dir={out}"])
    assert rc == 0
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    steps = {r["step"]: r for r in rows if "rollout/episodes" in r}  # steps 1-2: critic warm-up
    assert sorted(steps) == [1, 2, 3, 4, 5]
    for s, r in steps.items():
        gen = max(s - 1 - 2, 0)  # trained version s - 1, generated 2 versions before it (0 early)
        assert len(r["staleness/hist"]) - 1 == s - 1 - gen and r["staleness/hist"][-1] > 0
        per_step = {k for k in r if (p := parse_version_key(k)) and not p[2]}
        assert per_step == {f"rollout/{st}_by_version/v{gen}" for st in ("reward", "accuracy", "episodes")}
        assert r[f"rollout/episodes_by_version/v{gen}"] == r["rollout/episodes"] == 4.0
        assert r[f"rollout/reward_by_version/v{gen}"] == pytest.approx(r["rollout/reward_mean"])
        assert r[f"rollout/accuracy_by_version/v{gen}"] == pytest.approx(r["rollout/accuracy"])
    # version 0 generated steps 1-3: its total pools them (4, 8, 12 episodes), logged at each
    assert [steps[s]["rollout/episodes_by_version_total/v0"] for s in (1, 2, 3)] == [4.0, 8.0, 12.0]
    assert steps[3]["rollout/reward_by_version_total/v0"] == pytest.approx(
        sum(steps[s]["rollout/reward_mean"] for s in (1, 2, 3)) / 3)
    assert "rollout/episodes_by_version_total/v0" not in steps[4]  # no v0 episode trained at step 4
    pooled = pooled_from_metrics(rows)
    assert {v: t.episodes for v, t in pooled.items()} == {0: 12, 1: 4, 2: 4}
    assert pooled[0].reward == pytest.approx(steps[3]["rollout/reward_by_version_total/v0"])
    summary = json.loads((out / "summary.json").read_text())
    assert any(p.endswith("reward_by_version.png") for p in summary["plots"])
    # the held-out evaluations after steps 2 and 4 are drawn at the versions they evaluated
    ev_versions = sorted(int(steps[s]["eval/policy_version"]) for s in (2, 4))
    assert "eval/policy_version" not in steps[1] and "eval/policy_version" not in steps[3]
    acc_ax = by_version_figure(rows).axes[1]
    ev = [ln for ln in acc_ax.get_lines() if ln.get_label().startswith("eval/")]
    assert ev and all(list(ln.get_xdata()) == ev_versions for ln in ev)
