"""``copc view``: per-step training samples written by a real ``copc train`` run (tiny model, real
sandbox), the page built from them and from the held-out records, opened in headless Chromium
(Debian's package): episode count, filters and overlays checked in the DOM the browser built,
and a screenshot that is not blank."""

from __future__ import annotations

import json
import math
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from trainer.app.run import run_experiment
from trainer.config import ConfigError, load_config
from trainer.outputs.viewer.load import load_episodes
from trainer.outputs.viewer.samples import read_samples, write_step_samples

sys.path.insert(0, str(Path(__file__).parent.parent))
from ..app.test_run_e2e import overrides

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
needs_chromium = pytest.mark.skipif(CHROMIUM is None,
                                    reason="needs Debian's chromium (apt-get install chromium)")


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    """A 2-step on-policy (copc, staleness bound 0) run with held-out evaluation: samples + eval records."""
    out = tmp_path_factory.mktemp("run") / "r"
    cfg = load_config(None, overrides(out, "copc", steps=2, **{
        "train.staleness.max": "0", "eval.enabled": "true", "eval.num_samples": "3",
        "rollout.max_new_tokens": "24", "logging.samples_per_step": "2",
        # a wrong answer earns -1 (the random tiny model is always wrong): non-zero advantages
        "task.env_kwargs": "{prompt_template: 'Q: {problem}\n', reward: {incorrect_reward: -1.0}}"}))
    assert run_experiment(cfg)["steps"] == 2
    return out


def test_training_run_writes_per_step_samples_with_their_tensors(run_dir):
    recs = read_samples(run_dir)
    assert sorted({r["step"] for r in recs}) == [1, 2]
    assert [sum(r["step"] == s for r in recs) for s in (1, 2)] == [2, 2]  # samples_per_step
    for r in recs:
        n = len(r["tokens"])
        assert n > 0 and all(len(r[k]) == n for k in ("loss_mask", "advantage", "ratio", "versions"))
        model = [i for i in range(n) if r["loss_mask"][i]]
        assert model
        # on-policy (staleness 0): pi_old recomputed by the learner equals the behaviour policy,
        # so rho = exp(logp_old - logp_mu) is 1 up to float32 recomputation error
        assert all(abs(r["ratio"][i] - 1.0) < 2e-3 for i in model), r["ratio"]
        assert all(r["ratio"][i] == 1.0 and r["advantage"][i] == 0.0
                   for i in range(n) if not r["loss_mask"][i])
        assert all(math.isfinite(r["advantage"][i]) for i in model)
        assert r["policy_interval"] is None or r["policy_interval"][0] < 1 < r["policy_interval"][1]
        assert r["env_s"] >= 0 and r["llm_s"] > 0
    metrics = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    # every row of each step is sampled (2 episodes per step): the sampled advantages are the
    # step's own, so their mean over model tokens is the learner's advantage/mean
    for m in (m for m in metrics if "advantage/mean" in m):
        adv = [r["advantage"][i] for r in recs if r["step"] == m["step"] for i in range(len(r["tokens"]))
               if r["loss_mask"][i]]
        assert any(a != 0 for a in adv)
        assert np.mean(adv) == pytest.approx(m["advantage/mean"], rel=2e-3, abs=2e-4)
    assert all(m["perf/samples_s"] < 0.5 for m in metrics if "perf/samples_s" in m)


def test_sample_files_are_size_capped(run_dir, tmp_path):
    recs = read_samples(run_dir)
    per_token = ("tokens", "loss_mask", "advantage", "ratio", "versions")
    big = [{**recs[0], **{k: recs[0][k] * 40 for k in per_token}}]
    path = write_step_samples(tmp_path, 7, big + recs, max_bytes=8192)
    assert path == tmp_path / "samples" / "step_7.jsonl" and path.stat().st_size <= 8192
    cut = json.loads(path.read_text().splitlines()[0])
    assert cut["cut_tokens"] == len(big[0]["tokens"]) > len(cut["tokens"]) >= 16
    assert len(cut["ratio"]) == len(cut["tokens"]) == len(cut["loss_mask"])
    with pytest.raises(ConfigError, match=r"logging\.samples_per_step"):
        load_config(None, ["logging.samples_per_step=-1"])


def dom(url: str) -> str:
    """The DOM Chromium built after running the page's script."""
    res = subprocess.run([CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--dump-dom", url],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    assert 'data-ready="1"' in res.stdout, "the page's script did not finish"
    return re.sub(r"<(script|style)[^>]*>.*?</\1>", "", res.stdout, flags=re.S)  # what was drawn


def visible(html: str) -> int:
    """Episodes shown: those the filters did not hide (the page's counter agrees)."""
    n = len(re.findall(r'<details class="episode" data-k="\d+"(?! hidden)', html))
    assert int(re.search(r'id="count" data-visible="(\d+)"', html).group(1)) == n
    return n


@needs_chromium
def test_viewer_in_headless_chromium(run_dir, tmp_path):
    page = tmp_path / "view.html"
    res = subprocess.run([sys.executable, "-m", "trainer.cli", "view", str(run_dir), "--out", str(page)],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    text = page.read_text()
    assert "http://" not in text.replace("http://127.0.0.1", "") and "https://" not in text  # no network
    eps = load_episodes(run_dir)
    n_train = sum(e["source"] == "train" for e in eps)
    n_eval = len(eps) - n_train
    assert n_train == 4 and n_eval == 6  # 2 steps x 2 samples; before/after RL x 3 held-out rows
    url = page.as_uri()

    html = dom(url + "#open=all&overlay=none")
    assert html.count('<details class="episode"') == len(eps) == visible(html)
    assert "data-hl=" not in html
    assert html.count('class="turn model"') >= len(eps)
    # filters: a step, a benchmark, a finish reason, a reward range
    assert visible(dom(url + "#step=2")) == sum(e["step"] == 2 for e in eps) == 2
    assert visible(dom(url + "#benchmark=held_out")) == n_eval
    fin = eps[0]["finish"]
    assert visible(dom(url + f"#finish={fin}")) == sum(e["finish"] == fin for e in eps)
    assert visible(dom(url + "#rmin=2")) == 0
    # overlays on the opened training samples
    model_toks = sum(t["m"] for e in eps if e["source"] == "train" for t in e["tokens"])
    all_toks = sum(len(e["tokens"]) for e in eps if e["source"] == "train")
    mask = dom(url + "#open=all&overlay=mask")
    assert mask.count('data-hl="on"') == model_toks and mask.count('data-hl="off"') == all_toks - model_toks
    adv = dom(url + "#open=all&overlay=advantage")
    signs = adv.count('data-hl="pos"') + adv.count('data-hl="neg"')
    assert signs == sum(1 for e in eps if e["source"] == "train" for t in e["tokens"] if t["m"])
    expect_masked = sum(1 for e in eps if e["source"] == "train" and e["policy_interval"] for t in e["tokens"]
                        if t["m"] and not e["policy_interval"][0] < t["r"] < e["policy_interval"][1])
    assert dom(url + "#open=all&overlay=masked").count('data-hl="masked"') == expect_masked

    shot = tmp_path / "view.png"
    res = subprocess.run([CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                          "--window-size=1280,900", f"--screenshot={shot}", url + "#overlay=mask&open=2"],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0 and shot.exists(), res.stderr[-2000:]
    px = np.asarray(Image.open(shot).convert("RGB"), dtype=np.float64)
    assert px.shape == (900, 1280, 3)
    assert px.std() > 20  # not blank: text, coloured turns and tokens
    assert len(np.unique(px.reshape(-1, 3), axis=0)) > 50


@needs_chromium
def test_viewer_of_an_eval_dir_shows_tool_calls_and_outputs(model_tok, sandbox, tmp_path):
    """A ``copc eval``-style directory (results.jsonl of a real 3-turn sandbox episode): model
    turns, tool calls and tool outputs are drawn as distinct blocks."""
    import asyncio

    from scripted import scripted

    from environments.math_tool import MathToolEnv
    from trainer.engines.base import SamplingParams
    from trainer.engines.embedded import EmbeddedEngine
    from trainer.evaluate.kinds import make_kind
    from trainer.evaluate.records import record_of, write_records
    from trainer.rollout.agent_loop import run_episode

    from ..rollout.test_agent_loop import ACTIONS, SAMPLE, turn_of

    model, tok = model_tok

    async def play():
        eng = EmbeddedEngine(model, tok, logits_processor=scripted(tok, ACTIONS, turn_of))
        tr = await run_episode(eng, MathToolEnv(sandbox=sandbox), tok, SAMPLE,
                               SamplingParams(temperature=1.0, max_new_tokens=200))
        await eng.close()
        return tr

    tr = asyncio.run(play())
    assert tr.turns == 3 and tr.reward == 1.0
    rec = record_of(tr, make_kind("math"), index=0, benchmark="aime_toy", tokenizer=tok)
    wrong = {**rec.to_json(), "sample_index": 1, "reward": 0.0, "correct": False,
             "finish_reason": "max_turns"}
    write_records(tmp_path / "ev" / "results.jsonl", [rec, wrong])
    page = tmp_path / "ev.html"
    res = subprocess.run([sys.executable, "-m", "trainer.cli", "view", str(tmp_path / "ev"), "--out",
                          str(page)],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    html = dom(page.as_uri() + "#open=all")
    assert visible(html) == 2
    assert html.count('class="turn model"') == 6 and html.count('class="turn tool-out"') == 4
    assert html.count('<span class="call">&lt;code&gt;') == 4  # two <code> calls per episode
    assert "83810205" in html
    assert visible(dom(page.as_uri() + "#rmin=0.5")) == 1
    assert visible(dom(page.as_uri() + "#finish=max_turns")) == 1
    assert visible(dom(page.as_uri() + "#benchmark=aime_toy&rmax=0.5")) == 1


def test_view_of_an_empty_directory_exits_2(tmp_path, capsys):
    from trainer.cli import main
    assert main(["view", str(tmp_path)]) == 2
    assert "no samples/step_N.jsonl" in capsys.readouterr().err
