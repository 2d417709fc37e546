"""``copc eval`` records and the viewer show the gold answer; ``report.md`` states k, temperature,
seed and the config of each benchmark (issue 42 item 5d). The scripted engine and benchmarks of
``test_eval_cli`` (real NQ / AIME rows, real environments)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess

from trainer.cli import main as cli_main
from trainer.evaluate.records import read_results
from trainer.outputs.viewer.load import load_episodes

from .test_eval_cli import DATA, setup  # noqa: F401  (the module fixture)


def test_records_report_and_viewer_show_gold_and_settings(setup, tmp_path, monkeypatch):  # noqa: F811
    from environments.math_tool import load_math
    from environments.search.env import load_qa

    monkeypatch.setenv("COPC_TEST_ANSWER_KEY", str(setup["key"]))
    out = tmp_path / "ev"
    rc = cli_main(["eval", "--model", setup["model"], "--benchmarks", "nq,aime2024", "--max-samples", "2",
                   "--seed", "7", "--out", str(out), f"plugins=[{setup['plugin']}]",
                   "rollout.engine=scripted",
                   "logging.progress=false", f"task.data_dir={DATA}", "task.env=search",
                   f"task.settings.retriever_index_dir={setup['index']}"])
    assert rc == 0
    nq, aime = load_qa("nq", str(DATA), limit=2), load_math("aime2024", str(DATA), 2)
    records = read_results(out / "results.jsonl")
    gold = {(r["benchmark"], r["sample_index"]): r["gold"] for r in records}
    assert gold == {("nq", 0): nq[0]["golden_answers"], ("nq", 1): nq[1]["golden_answers"],
                    ("aime2024", 0): aime[0]["answer"], ("aime2024", 1): aime[1]["answer"]}

    md = (out / "report.md").read_text()
    assert "per benchmark" not in md
    assert "- **k**: nq 1, aime2024 32" in md and "- **temperature**: nq 0.0, aime2024 1.0" in md
    assert "| failed questions | k | temperature | seed |" in md
    rows = {line.split(" | ")[0].strip("| "): line.split(" | ")[-3:] for line in md.splitlines()
            if line.startswith(("| nq ", "| aime2024 "))}
    assert rows == {"nq": ["1", "0.0", "7 |"], "aime2024": ["32", "1.0", "7 |"]}
    assert '- **nq**: env="search", data="nq", kind="qa"' in md
    assert '- **aime2024**: env="math_tool", data="aime2024", kind="math"' in md
    report = json.loads((out / "report.json").read_text())["benchmarks"]
    assert (report["nq"]["seed"], report["nq"]["config"]["kind"]) == (7, "qa")

    eps = load_episodes(out)
    assert sorted(str(e["gold"]) for e in eps) == sorted(str(r["gold"]) for r in records)
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium:  # the page draws it
        page = tmp_path / "v.html"
        assert cli_main(["view", str(out), "--out", str(page)]) == 0
        html = subprocess.run([chromium, "--headless", "--no-sandbox", "--disable-gpu", "--dump-dom",
                               page.as_uri() + "#open=all"],
                              capture_output=True, text=True, timeout=120).stdout
        drawn = re.findall(r'<div class="answer">answer <b>[^\']', html)  # not the script's own text
        assert len(drawn) == len(records) == 2 + 2 * 32
        assert f"gold <b>{aime[0]['answer']}</b>" in html
        assert f"gold <b>{' | '.join(nq[0]['golden_answers'])}</b>" in html
