"""The one evaluation core: a user benchmark kind registered from a plugin file with its own
settings, used by ``copc eval``; and ``copc train``'s held-out evaluation and ``copc eval``
writing identical records for the same model, rows and seed (real tiny model, real sandbox env)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from trainer.cli import main as cli_main
from trainer.config import load_config
from trainer.config.specs import task_spec
from trainer.evaluate.kinds import BENCHMARK_KINDS
from trainer.evaluate.records import read_records, read_results
from trainer.models.tiny import TinyModelConfig, save_tiny_checkpoint

pytestmark = pytest.mark.usefixtures("one_torch_thread")

KIND_PLUGIN = '''
from dataclasses import dataclass

from trainer.evaluate.kinds import BENCHMARK_KINDS, BenchmarkKind, KindSettings


@dataclass(frozen=True)
class GradedSettings(KindSettings):
    threshold: float = 0.5   # an episode is solved when its reward >= threshold

    def __post_init__(self):
        super().__post_init__()
        if not -1.0 <= self.threshold <= 1.0:
            raise ValueError(f"threshold={self.threshold!r}: must be in [-1, 1]")


class GradedKind(BenchmarkKind):
    row_fields = ("problem", "answer")

    def score(self, tr):
        return tr.reward >= self.settings.threshold, {"reward": float(tr.reward)}

    def headline(self, n):
        return f"solved@{n}"

    def metrics(self, groups, n, ks):
        solved = [sum(r["correct"] for r in g) / len(g) for g in groups]
        return {f"solved@{n}": solved}, {"threshold": self.settings.threshold}


if "graded" not in BENCHMARK_KINDS:
    BENCHMARK_KINDS.register("graded", GradedKind, settings=GradedSettings)
'''

ROWS = [{"id": "p1", "problem": "What is 6 times 7?", "answer": 42},
        {"id": "p2", "problem": "What is 5 plus 8?", "answer": 13}]
TINY = {"model.tiny.hidden_size": "32", "model.tiny.intermediate_size": "64", "model.tiny.num_layers": "1"}


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    d = tmp_path_factory.mktemp("evalcore")
    return save_tiny_checkpoint(d / "tiny", TinyModelConfig(hidden_size=32, intermediate_size=64,
                                                            num_layers=1))


def _jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_user_kind_from_a_plugin_file_with_its_own_settings(tiny_model, tmp_path, capsys):
    plugin = tmp_path / "graded_kind.py"
    plugin.write_text(KIND_PLUGIN)
    rows = _jsonl(tmp_path / "sums.jsonl", ROWS)

    def run(out: str, *settings: str) -> int:
        return cli_main(["eval", "--model", str(tiny_model), "--benchmarks", f"{rows}:math_tool:graded",
                         "--k", "1", "--temperature", "0", "--out", str(tmp_path / out),
                         f"plugins=[{plugin}]", "rollout.max_new_tokens=8", "rollout.max_turns=1",
                         "logging.progress=false", *settings])

    try:
        # the tiny random model never boxes the right number: every reward is 0
        assert run("strict") == 0  # the kind's default threshold 0.5: nothing solved
        strict = json.loads((tmp_path / "strict" / "report.json").read_text())["benchmarks"]["sums"]
        assert (strict["kind"], strict["headline"], strict["solved@1"], strict["threshold"]) == \
            ("graded", "solved@1", 0.0, 0.5)
        assert run("lenient", "eval.kind_settings.graded.threshold=0.0") == 0  # reward 0 >= 0: all solved
        lenient = json.loads((tmp_path / "lenient" / "report.json").read_text())["benchmarks"]["sums"]
        assert (lenient["solved@1"], lenient["solved@1_ci95"], lenient["threshold"]) == (1.0, [1.0, 1.0], 0.0)
        recs = read_results(tmp_path / "lenient" / "results.jsonl")
        assert [(r["sample_id"], r["correct"], r["score_components"])
                for r in sorted(recs, key=lambda r: r["sample_index"])] == \
            [("p1", True, {"reward": 0.0}), ("p2", True, {"reward": 0.0})]
        assert "| sums | solved@1 | 1.000 [1.00, 1.00]" in (tmp_path / "lenient" / "report.md").read_text()
        capsys.readouterr()
        # settings the kind's dataclass does not have or rejects: one line naming the key, exit 2
        assert run("bad", "eval.kind_settings.graded.nope=1") == 2
        err = capsys.readouterr().err
        assert "eval.kind_settings.graded.nope=1: unknown setting of GradedSettings" in err
        assert run("bad2", "eval.kind_settings.graded.threshold=3") == 2
        assert "eval.kind_settings.graded.threshold=3.0: must be in [-1, 1]" in capsys.readouterr().err
    finally:
        if "graded" in BENCHMARK_KINDS:
            BENCHMARK_KINDS.unregister("graded")


def test_train_evaluation_and_copc_eval_write_identical_records(tmp_path):
    """Before RL, ``copc train`` evaluates its held-out rows with the initial model; ``copc eval``
    of the same model on the same rows (a JSONL file) at the same seed gives the same records,
    episode for episode (sampled at temperature 1, two episodes per row: the seeds matter)."""
    from trainer.app.run import run_experiment
    from trainer.tasks import build_task

    out = tmp_path / "run"
    common = {**TINY, "rollout.max_new_tokens": "8", "rollout.max_turns": "1", "rollout.concurrency": "4",
              "logging.progress": "false", "task.env": "math_tool"}
    over = {**common, "preset": "copc", "output_dir": str(out), "task.train_data": "[math_train]",
            "task.max_train_samples": "8", "train.total_steps": "1", "train.prompts_per_step": "2",
            "train.micro_batch_size": "4", "eval.enabled": "true", "eval.num_samples": "3", "eval.k": "2",
            "eval.temperature": "1.0", "warm_start.enabled": "false", "logging.plots": "false"}
    cfg = load_config(None, [f"{k}={v}" for k, v in over.items()])
    task = build_task(task_spec(cfg))
    try:
        held_rows = list(task.eval_samples)
        held = _jsonl(tmp_path / "held_out.jsonl", held_rows)  # the file stem names the benchmark
    finally:
        task.close()
    summary = run_experiment(cfg)
    train = read_records(out / "eval" / "before_rl.jsonl")
    assert len(train) == 6 and summary["eval_before"]["n"] == 3.0

    assert cli_main(["eval", "--model", str(out / "init_model"), "--benchmarks", f"{held}:math_tool:math",
                     "--k", "2", "--temperature", "1.0", "--seed", str(cfg.train.seed),
                     "--out", str(tmp_path / "ev"), *[f"{k}={v}" for k, v in common.items()]]) == 0
    ev = sorted(read_results(tmp_path / "ev" / "results.jsonl"),
                key=lambda r: (r["sample_index"], r["episode"]))
    assert [(r["sample_index"], r["episode"]) for r in train] == [(i, j) for i in range(3) for j in range(2)]
    # every field: prompt, response, seed, reward, answer, statistics; the timings (llm_s, env_s,
    # other_s: wall-clock measurements) are real numbers in both but differ from run to run
    timing = ("llm_s", "env_s", "other_s")
    assert all(isinstance(r[k], float) and r[k] >= 0 for r in ev + train for k in timing)
    assert [{k: v for k, v in r.items() if k not in timing} for r in ev] == \
        [{k: v for k, v in r.items() if k not in timing} for r in train]
    assert {r["benchmark"] for r in train} == {"held_out"} and len({r["seed"] for r in train}) == 6
    assert [r["gold"] for r in train] == [str(row["answer"]) for row in held_rows for _ in range(2)]
    assert len({r["response"] for r in train}) > 1  # sampled: the episodes differ


def test_train_held_out_records_carry_the_gold_answer(tiny_model, tmp_path):
    """``copc train``'s held-out evaluation (the run's :func:`held_out_spec`, the generated
    arithmetic rows of ``train.seed`` 0) writes each row's gold answer in its records, as
    ``copc eval`` does; the spec carries the config's values."""
    import asyncio

    from trainer.config.specs import engine_spec, held_out_spec
    from trainer.engines import make_engine
    from trainer.evaluate.heldout import evaluate_held_out
    from trainer.models.loading import load_tokenizer
    from trainer.tasks import build_task

    over = {**TINY, "model.path": str(tiny_model), "task.env": "math_tool",
            "output_dir": str(tmp_path / "run"), "rollout.max_new_tokens": "4", "rollout.max_turns": "1",
            "logging.progress": "false", "eval.num_samples": "2", "eval.k": "2", "eval.temperature": "0",
            "train.seed": "0"}
    cfg = load_config(None, [f"{k}={v}" for k, v in over.items()])
    spec = held_out_spec(cfg)
    assert (spec.k, spec.temperature, spec.seed, spec.max_new_tokens, spec.agent.max_turns, spec.progress,
            spec.output_dir) == (2, 0.0, 0, 4, 1, False, tmp_path / "run")
    tok = load_tokenizer(tiny_model)
    handle = make_engine(cfg.rollout.engine, engine_spec(cfg, tiny_model, tok))
    task = build_task(task_spec(cfg))
    try:
        summary = asyncio.run(evaluate_held_out(spec, handle.engine, task, tok, "before_rl"))
    finally:
        task.close()
        asyncio.run(handle.close())
    records = read_records(tmp_path / "run" / "eval" / "before_rl.jsonl")
    assert summary["n"] == 2.0 and len(records) == 4
    # held-out row 0 of the stream of seed 0: the 2001st problem (2000 training rows come first)
    first = [r for r in records if r["sample_id"] == "arith-0-2000"]
    assert [(r["episode"], r["gold"]) for r in first] == [(0, "314132"), (1, "314132")]
    assert 755 * 425 - 6743 == 314132 and "755 * 425 - 6743" in first[0]["prompt"]
    assert [r["gold"] for r in records] == [row["answer"] for row in task.eval_samples for _ in range(2)]
