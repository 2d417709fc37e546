"""``copc eval --endpoint``: the real CLI against the SGLang protocol stand-in started by the real
:class:`~trainer.engines.sglang_launcher.SGLangLauncher` (issue 21 item 11).

A server answering with a token id outside the policy tokenizer's vocabulary must make that
episode an infrastructure failure (recorded, retried, excluded from the score), never crash the
whole evaluation; every other episode is scored as usual.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import httpx
import pytest

from trainer.cli import main as cli_main
from trainer.engines.sglang_launcher import SGLangLauncher, SGLangLauncherConfig
from trainer.evaluate.records import read_results
from trainer.models.tiny import TinyModelConfig, build_byte_tokenizer, save_tiny_checkpoint

DATA = Path(__file__).parent.resolve().parents[2] / "data"
STANDIN_DIR = Path(__file__).parent.parent / "sglang_protocol_standin"


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """The stand-in (vocabulary 260: bytes + 4 specials, EOS 259) and a tokenizer of the same size."""
    d = tmp_path_factory.mktemp("endpoint")
    tok = build_byte_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": ["<|x0|>", "<|x1|>"]})
    assert len(tok) == 260
    tiny = TinyModelConfig(hidden_size=16, intermediate_size=32, num_layers=1)
    model = save_tiny_checkpoint(d / "tok", tiny, tokenizer=tok)
    env = {"PYTHONPATH": os.pathsep.join([str(STANDIN_DIR), os.environ.get("PYTHONPATH", "")])}
    cfg = SGLangLauncherConfig(model_path=str(model), extra_env=env, show_progress=False, poll_interval_s=0.1,
                               shutdown_grace_s=5.0)
    with SGLangLauncher(cfg) as launcher:
        yield {"url": launcher.url, "tokenizer": str(model), "dir": d}


def _control(url: str, **kw) -> None:
    httpx.post(f"{url}/_standin/control", json={"reset": True, **kw}).raise_for_status()


def _eval(served, out: Path, *extra: str) -> int:
    return cli_main(["eval", "--endpoint", served["url"], "--tokenizer", served["tokenizer"],
                     "--benchmarks", "aime2024", "--max-samples", "2", "--k", "2", "--out", str(out),
                     *extra, "logging.progress=false", f"task.data_dir={DATA}", "rollout.max_new_tokens=8",
                     "rollout.max_turns=1"])


def _oov_answer(token: int) -> dict:
    return {"text": "", "meta_info": {"finish_reason": {"type": "length", "length": 1},
                                      "output_token_logprobs": [[-0.5, token, None]]}}


def test_out_of_vocabulary_token_fails_that_play_only(served, tmp_path):
    """One episode; its first play gets 4 out-of-vocabulary answers (the first call and the agent
    loop's 3 retries): that play is an infrastructure failure, the episode is played again with
    ordinary answers and scored; the evaluation finishes (exit 0)."""
    _control(served["url"], respond=[_oov_answer(300)] * 4)
    out = tmp_path / "ev"
    assert _eval(served, out, "--max-samples", "1", "--k", "1") == 0
    (r,) = read_results(out / "results.jsonl")
    assert r["attempts"] == 2 and not r["failed"] and r["finish_reason"] == "terminated"
    assert [x["path"] for x in httpx.get(f"{served['url']}/_standin/requests").json()].count("/generate") == 5


def test_every_answer_out_of_vocabulary_is_a_failed_evaluation_not_a_crash(served, tmp_path):
    """With every answer out of vocabulary, each episode is played 3 times, recorded as failed
    naming the token, and the report counts 4 failed episodes and no score."""
    _control(served["url"], respond=[_oov_answer(10**6)] * 4 * 4 * 3)  # 4 episodes x 3 plays x 4 calls
    out = tmp_path / "ev"
    _eval(served, out)
    records = read_results(out / "results.jsonl")
    assert len(records) == 4 and all(r["failed"] and r["attempts"] == 3 for r in records)
    assert all("=1000000: outside the tokenizer's vocabulary" in r["finish_reason"] for r in records)
    assert json.loads((out / "report.json").read_text())["benchmarks"]["aime2024"]["failed_episodes"] == 4


def test_request_timeout_flag_is_a_total_deadline(served, tmp_path):
    """``--request-timeout-s 1`` against a server trickling its answer: every episode is a
    failed (infrastructure) episode after ~1 s per play, the evaluation ends."""
    _control(served["url"], trickle_s=0.05)
    out = tmp_path / "ev"
    _eval(served, out, "--request-timeout-s", "1", "--max-samples", "1", "--k", "1")
    records = read_results(out / "results.jsonl")
    assert len(records) == 1 and records[0]["failed"] and records[0]["attempts"] == 3
    assert "request_timeout_s=1 s" in records[0]["finish_reason"]
    _control(served["url"])


def test_request_timeout_flag_must_be_positive(served, tmp_path, capsys):
    assert _eval(served, tmp_path / "ev", "--request-timeout-s", "0") == 2
    assert "--request-timeout-s=0.0: must be > 0" in capsys.readouterr().err


def test_resume_refuses_another_tokenizer_for_the_same_endpoint(served, tmp_path, capsys):
    """Issue 21 item 10 (review): with ``--endpoint`` the prompts are token ids made by ``--tokenizer``;
    resuming the same URL with another tokenizer changes every prompt, so it exits 2 naming the flag."""
    out = tmp_path / "ev"
    _control(served["url"])
    assert _eval(served, out, "--max-samples", "1", "--k", "1") == 0
    other = tmp_path / "tok2"
    import shutil

    shutil.copytree(served["tokenizer"], other)
    cfg = json.loads((other / "tokenizer_config.json").read_text())
    cfg["chat_template"] = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    (other / "tokenizer_config.json").write_text(json.dumps(cfg))
    capsys.readouterr()
    argv = ["eval", "--endpoint", served["url"], "--tokenizer", str(other), "--benchmarks", "aime2024",
            "--max-samples", "1", "--k", "1", "--out", str(out), "--resume", "logging.progress=false",
            f"task.data_dir={DATA}", "rollout.max_new_tokens=8", "rollout.max_turns=1"]
    assert cli_main(argv) == 2
    assert "--tokenizer=" in capsys.readouterr().err.strip().splitlines()[-1]

