"""``copc analyze``: the written numbers are the library's, the heatmap is a PNG, bad options fail cleanly."""

from __future__ import annotations

import json

import pytest
import torch

from copc.coupling import coordination_reversal, coupling_grid, find_reversals
from copc.token_tree import TokenTree
from trainer.cli import main as cli_main


def test_analyze_writes_the_library_numbers_and_a_png(tmp_path, capsys):
    out = tmp_path / "an"
    rc = cli_main(["analyze", "--vocab", "2", "--horizon", "3", "--seed", "3", "--staleness-scale", "0.7",
                   "--critic-noise", "0.2", "--lam", "0.9", "--n", "4", "--eta-p", "0.25,0.5,0.75",
                   "--eta-a", "0.25,0.75", "--out", str(out)])
    assert rc == 0
    data = json.loads((out / "analysis.json").read_text())
    tree = TokenTree.random(2, 3, generator=torch.Generator().manual_seed(3), staleness_scale=0.7,
                            critic_noise=0.2, lam=0.9)
    grid = coupling_grid(tree, (0.25, 0.5, 0.75), (0.25, 0.75), n=4)
    for key, value in grid.metrics.items():
        assert data["grid"][key] == value.tolist(), key
    assert data["grid"]["eta_p"] == [0.25, 0.5, 0.75] and data["grid"]["n"] == 4
    assert data["grid"]["g_star_norm"] == grid.g_star_norm > 0
    # MSE = bias² + Var/N cell by cell in the file itself
    for i in range(3):
        for j in range(2):
            assert data["grid"]["mse"][i][j] == pytest.approx(
                data["grid"]["bias2"][i][j] + data["grid"]["variance"][i][j] / 4, abs=1e-15)
    rev = coordination_reversal(grid)
    assert data["reversal"]["effect_strong"] == rev.effect_strong
    assert data["reversal"]["reversal"] is rev.reversal
    assert len(data["reversals"]) == len(find_reversals(grid))
    assert data["config"]["staleness_scale"] == 0.7 and data["config"]["seed"] == 3
    png = (out / "mse_heatmap.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
    text = capsys.readouterr().out
    assert "coordination reversal" in text and ("YES" if rev.reversal else "no") in text


def test_analyze_without_the_paper_cells_reports_no_reversal_check(tmp_path, capsys):
    rc = cli_main(["analyze", "--vocab", "2", "--horizon", "2", "--eta-p", "0.5,1", "--eta-a", "0,1",
                   "--out", str(tmp_path)])
    assert rc == 0
    assert json.loads((tmp_path / "analysis.json").read_text())["reversal"] is None
    assert "not checked" in capsys.readouterr().out


@pytest.mark.parametrize(("args", "needle"), [(["--vocab", "1"], "vocab"),
                                              (["--eta-a", "0.5,1.5"], "eta_a"),
                                              (["--critic-noise", "-1"], "critic_noise"),
                                              (["--n", "0"], "n (trajectories")])
def test_analyze_bad_options_exit_2_naming_the_field(tmp_path, capsys, args, needle):
    assert cli_main(["analyze", *args, "--out", str(tmp_path / "x")]) == 2
    assert needle in capsys.readouterr().err
    assert not (tmp_path / "x").exists()


def test_the_reversal_rate_script_counts_what_copc_analyze_reports(tmp_path, capsys):
    """scripts/reversal_rate.py (the docs' table) on 2 seeds: each setting's rate is the fraction of
    ``copc analyze`` runs (same tree options and N) whose analysis.json has a reversal."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).parent.resolve().parents[2] / "scripts" / "reversal_rate.py"
    spec = importlib.util.spec_from_file_location("reversal_rate", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    rates = mod.reversal_rates(2, [16], 3, 4)["16"]
    assert len(rates["per_setting"]) == len(mod.STALENESS) * len(mod.CRITIC_NOISE) == 12
    for s in (0.5, 2.0):
        hits = 0
        for seed in range(2):
            out = tmp_path / f"s{s}-{seed}"
            assert cli_main(["analyze", "--seed", str(seed), "--staleness-scale", str(s), "--critic-noise",
                             "1.0", "--n", "16", "--out", str(out)]) == 0
            hits += json.loads((out / "analysis.json").read_text())["reversal"]["reversal"]
        assert rates["per_setting"][f"s={s:g},noise=1"] == hits / 2
    assert "N = 16" in capsys.readouterr().out
    assert rates["rate"] == sum(rates["per_setting"].values()) / 12
    assert 0.0 <= rates["paper_direction_rate"] <= rates["rate"] <= 1.0
