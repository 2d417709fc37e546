"""``copc eval --benchmarks``: real benchmarks, real envs (BM25 retriever, bwrap sandbox), a
scripted policy registered through ``plugins`` (an engine that answers from a key file), resume
and infrastructure failures.

The scripted engine is a legitimate user engine (one registration): it answers the question it
finds in the prompt — right for even question indices, wrong for odd ones — and fails
(``EngineError``) on a question listed as broken, so every number in the report is known.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from trainer.cli import main as cli_main
from trainer.evaluate.metrics import summarize_benchmark
from trainer.evaluate.records import latest_records, read_results
from trainer.models.tiny import TinyModelConfig, save_tiny_checkpoint
from trainer.outputs.viewer.load import load_episodes

DATA = Path(__file__).parent.resolve().parents[2] / "data"

PLUGIN = '''
import asyncio, json, os
from trainer.engines import EngineHandle, register_engine
from trainer.engines.base import EngineError, GenerationResult

class ScriptedEngine:
    version = 0

    def __init__(self, tok):
        self.tok = tok
        # question text -> [reply, right?, broken?]; read per engine (the module is imported once)
        self.key = json.load(open(os.environ["COPC_TEST_ANSWER_KEY"]))

    async def generate(self, prompt_ids, params):
        await asyncio.sleep(float(os.environ.get("COPC_TEST_DELAY_S", "0")))
        prompt = self.tok.decode(prompt_ids, skip_special_tokens=True)
        for q, (answer, right, broken) in self.key.items():
            if q in prompt:
                if answer.startswith("<search>") and os.environ.get("COPC_TEST_KILL_PID"):
                    os.kill(int(os.environ.pop("COPC_TEST_KILL_PID")), 9)  # the retriever dies now
                if broken:
                    raise EngineError("scripted engine: this question breaks the engine")
                text = answer
                ids = self.tok.encode(text, add_special_tokens=False)
                return GenerationResult(ids, [-0.1] * len(ids), [0] * len(ids), "stop", text)
        raise AssertionError("question not in the key: " + prompt[-200:])

    async def update_weights(self, source, version): ...
    async def pause(self): ...
    async def resume(self): ...
    async def close(self): ...


def factory(spec):
    eng = ScriptedEngine(spec.tokenizer)

    async def sync(weights, version):
        pass

    return EngineHandle(eng, sync, eng.close)


register_engine("scripted", factory, overwrite=True)
'''


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """Tiny model (tokenizer), plugin, answer key for 4 NQ + 4 HotpotQA + 4 AIME-2024 questions."""
    from environments.math_tool import load_math
    from environments.search.env import load_qa

    d = tmp_path_factory.mktemp("evalcli")
    model = save_tiny_checkpoint(d / "tiny", TinyModelConfig(hidden_size=32, intermediate_size=64,
                                                             num_layers=1))
    (d / "scripted_engine.py").write_text(PLUGIN)
    key = {}  # question -> [the scripted reply, right?, breaks the engine?]
    for name in ("nq", "hotpotqa"):
        for i, row in enumerate(load_qa(name, str(DATA), limit=4)):
            reply = row["golden_answers"][0] if i % 2 == 0 else "certainly not this"
            key[row["question"]] = [f"<answer>{reply}</answer>", i % 2 == 0, False]
            if name == "hotpotqa" and i == 3:  # never answers: cut by the turn budget, scores 0
                key[row["question"]][0] = "I do not know."
    for i, row in enumerate(load_math("aime2024", str(DATA), 4)):
        reply = row["answer"] if i % 2 == 0 else "-1"
        key[row["problem"]] = ["The answer is \\boxed{" + str(reply) + "}.", i % 2 == 0, i == 3]
    (d / "key.json").write_text(json.dumps(key))
    index = tmp_path_factory.getbasetemp() / "trainer_bm25_index"  # shared with the other search tests
    return {"dir": d, "model": str(model), "plugin": str(d / "scripted_engine.py"), "key": d / "key.json",
            "index": str(index)}


def _eval(setup, out, *extra):
    return cli_main(["eval", "--model", setup["model"], "--benchmarks", "nq,hotpotqa,aime2024",
                     "--max-samples", "4", "--out", str(out), *extra,
                     f"plugins=[{setup['plugin']}]", "rollout.engine=scripted", "logging.progress=false",
                     f"task.data_dir={DATA}", "task.env=search",
                     f"task.settings.retriever_index_dir={setup['index']}"])


def test_report_equals_recomputation_resume_and_failures(setup, tmp_path, monkeypatch):
    monkeypatch.setenv("COPC_TEST_ANSWER_KEY", str(setup["key"]))
    out = tmp_path / "ev"
    assert _eval(setup, out, "--k", "2") == 0
    report = json.loads((out / "report.json").read_text())["benchmarks"]
    records = read_results(out / "results.jsonl")
    # 4 questions x 2 episodes per benchmark; AIME question 3 breaks the engine: retried, then failed
    assert len(records) == 3 * 4 * 2
    for name in ("nq", "hotpotqa"):
        assert report[name]["em"] == pytest.approx(0.5)            # right on questions 0 and 2
        assert report[name]["failed_episodes"] == 0
    aime = report["aime2024"]
    assert aime["failed_episodes"] == 2 and aime["questions"] == 3  # excluded, not scored 0
    assert aime["avg@2"] == pytest.approx(2 / 3)                      # questions 0, 2 right; 1 wrong
    failed = [r for r in records if r["failed"]]
    assert {(r["sample_index"], r["attempts"]) for r in failed} == {(3, 3)}  # 1 try + 2 retries
    assert all(r["finish_reason"].startswith("engine_error") for r in failed)
    for name, summary in report.items():  # every number recomputed from results.jsonl
        recs = [r for r in records if r["benchmark"] == name]
        again = summarize_benchmark(recs, "qa" if name != "aime2024" else "math")
        assert {k: v for k, v in again.items()} == {k: v for k, v in summary.items() if k in again}
    assert (out / "report.md").read_text().count("| nq ") == 1 and (out / "report.png").stat().st_size > 0
    cut = next(r for r in records if r["benchmark"] == "hotpotqa" and r["sample_index"] == 3)
    assert cut["answer"] is None and cut["score_components"]["f1"] == 0.0 and not cut["failed"]
    ep = next(r for r in records if r["benchmark"] == "nq" and r["sample_index"] == 0)
    assert ep["correct"] and ep["score_components"]["em"] == 1.0 and ep["prompt"] and ep["answer"]

    # the same --out without --resume is refused; a killed run (half the lines left) resumes
    assert _eval(setup, out, "--k", "2") == 2
    lines = (out / "results.jsonl").read_text().splitlines(keepends=True)
    (out / "results.jsonl").write_text("".join(lines[: len(lines) // 2]) + lines[len(lines) // 2][:7])
    assert _eval(setup, out, "--k", "2", "--resume") == 0
    latest = latest_records(read_results(out / "results.jsonl"))
    assert len(latest) == 24  # nothing missing, nothing twice
    assert json.loads((out / "report.json").read_text())["benchmarks"] == report


@pytest.mark.parametrize(("args", "needle"), [
    (["--benchmarks", "nq,nope"], "--benchmarks='nope': unknown benchmark 'nope'"),
    (["--benchmarks", "nq", "--k", "0"], "--k=0: must be an int >= 1"),
    (["--benchmarks", "nq", "--model", "/no/such/dir"], "--model='/no/such/dir': not a save_pretrained"),
    (["--benchmarks", "nq", "--endpoint", "http://127.0.0.1:9"],
     "--endpoint='http://127.0.0.1:9': does not answer"),
    (["--benchmarks", "nq", "--model", "x", "--endpoint", "http://127.0.0.1:9"], "give exactly one"),
    (["--benchmarks", "nq,nq"], "--benchmarks='nq': a benchmark named 'nq' is already in the list"),
    (["--benchmarks", "/no/such.jsonl:search"], "--benchmarks='/no/such.jsonl:search'"),
    (["--benchmarks", "nq", "--temperature", "inf"], "--temperature=inf: must be a finite number"),
])
def test_bad_input_is_one_line_exit_2(setup, tmp_path, capsys, args, needle, monkeypatch):
    argv = ["eval", *args, "--out", str(tmp_path / "o")]
    if "--model" not in args and "--endpoint" not in args:
        argv += ["--model", setup["model"]]
    if "--endpoint" in args and "--model" not in args:
        argv += ["--tokenizer", setup["model"]]
    monkeypatch.chdir(tmp_path)
    assert cli_main([*argv, f"task.data_dir={DATA}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("copc eval: config error: ") and needle in err[-1], err
    assert not (tmp_path / "o").exists()  # nothing written for a bad command


def test_rows_the_env_cannot_read_and_resume_with_other_settings(setup, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("COPC_TEST_ANSWER_KEY", str(setup["key"]))
    qa = tmp_path / "myqa.jsonl"
    qa.write_text(json.dumps({"id": "u0", "question": "who?", "golden_answers": ["x"]}) + "\n")
    base = ["eval", "--model", setup["model"], "--out", str(tmp_path / "o"), f"plugins=[{setup['plugin']}]",
            "rollout.engine=scripted", "logging.progress=false", f"task.data_dir={DATA}",
            "task.env=search", f"task.settings.retriever_index_dir={setup['index']}"]
    assert cli_main([*base, "--benchmarks", f"{qa}:math_tool"]) == 2  # QA rows in the math env
    assert "env 'math_tool' cannot read its rows" in capsys.readouterr().err
    assert cli_main([*base, "--benchmarks", "nq", "--max-samples", "2"]) == 0
    assert cli_main([*base, "--benchmarks", "nq", "--max-samples", "2", "--resume", "--seed", "5"]) == 2
    assert "--seed=5: the run in" in capsys.readouterr().err.strip().splitlines()[-1]
    assert cli_main([*base, "--benchmarks", "nq", "--max-samples", "2", "--resume"]) == 0


def test_sigkill_mid_run_then_resume_loses_nothing(setup, tmp_path):
    """A real kill -9 of ``copc eval`` while episodes are being written, then ``--resume``."""
    import os
    import signal
    import subprocess
    import sys
    import time

    out = tmp_path / "killed"
    argv = [sys.executable, "-m", "trainer.cli", "eval", "--model", setup["model"], "--benchmarks", "nq",
            "--max-samples", "4", "--k", "4", "--out", str(out), f"plugins=[{setup['plugin']}]",
            "rollout.engine=scripted", "logging.progress=false", f"task.data_dir={DATA}",
            "task.env=search", f"task.settings.retriever_index_dir={setup['index']}",
            "rollout.concurrency=1"]
    env = {**os.environ, "COPC_TEST_ANSWER_KEY": str(setup["key"]), "COPC_TEST_DELAY_S": "0.3",
           "PYTHONPATH": str(Path.cwd())}
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 120
    while not (out / "results.jsonl").exists() or len((out / "results.jsonl").read_text().splitlines()) < 4:
        assert proc.poll() is None, proc.stderr.read().decode()[-2000:]
        assert time.monotonic() < deadline
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()

    def children_of_killed() -> list[str]:  # the BM25 server it started, found by its --parent-pid
        found = []
        for d in Path("/proc").iterdir():
            try:
                cmd = (d / "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if b"--parent-pid" in cmd and cmd[cmd.index(b"--parent-pid") + 1] == str(proc.pid).encode():
                found.append(d.name)
        return found

    t0 = time.monotonic()
    while children_of_killed() and time.monotonic() - t0 < 15:
        time.sleep(0.2)
    assert children_of_killed() == []  # the retriever server did not outlive the killed run
    written = len((out / "results.jsonl").read_text().splitlines())
    assert 4 <= written < 16  # killed mid-run
    env["COPC_TEST_DELAY_S"] = "0"
    res = subprocess.run([*argv, "--resume"], env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    records = read_results(out / "results.jsonl")
    latest = latest_records(records)
    assert len(latest) == 16 and len(records) == 16  # none lost, none played twice
    assert json.loads((out / "report.json").read_text())["benchmarks"]["nq"]["em"] == pytest.approx(0.5)


def test_same_command_twice_gives_the_same_report_with_the_embedded_engine(setup, tmp_path):
    """Reproducible: fixed seeds per (question, episode); a real (random tiny) model, sampled."""
    reports, episodes = [], []
    for run in ("a", "b"):
        out = tmp_path / run
        assert cli_main(["eval", "--model", setup["model"], "--benchmarks", "nq,aime2024",
                         "--max-samples", "2", "--k", "2", "--temperature", "1.0", "--out", str(out),
                         "logging.progress=false", "rollout.max_new_tokens=16", f"task.data_dir={DATA}",
                         "task.env=search", f"task.settings.retriever_index_dir={setup['index']}"]) == 0
        reports.append(json.loads((out / "report.json").read_text())["benchmarks"])
        latest = latest_records(read_results(out / "results.jsonl"))
        episodes.append({key: (r["response"], r["seed"]) for key, r in latest.items()})
        assert len(latest) == 8 and len({t for t, _ in episodes[-1].values()}) > 1  # sampled, not constant
    assert reports[0] == reports[1] and episodes[0] == episodes[1]


def test_retriever_outage_is_reported_as_failed_not_wrong(setup, tmp_path, monkeypatch):
    """The retriever dies mid-run (killed when question 1 searches): those episodes are failures,
    excluded and counted, never wrong answers; a dead --retriever-url is refused up front."""
    import socket

    from environments.search.env import load_qa
    from retriever.launch import ensure_bm25_index, start_server

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}"
    assert cli_main(["eval", "--model", setup["model"], "--benchmarks", "nq", "--retriever-url", dead,
                     "--out", str(tmp_path / "refused"), f"task.data_dir={DATA}"]) == 2
    key = json.loads(setup["key"].read_text())
    row = load_qa("nq", str(DATA), limit=4)[1]
    key[row["question"]] = ["<search>who is it</search>", False, False]   # question 1 searches
    (tmp_path / "key.json").write_text(json.dumps(key))
    index = Path(setup["index"])
    ensure_bm25_index(DATA / "wiki" / "corpus.jsonl", index, show_progress=False)
    server = start_server(index, log_path=tmp_path / "server.log")
    monkeypatch.setenv("COPC_TEST_ANSWER_KEY", str(tmp_path / "key.json"))
    monkeypatch.setenv("COPC_TEST_KILL_PID", str(server.proc.pid))
    out = tmp_path / "down"
    try:
        assert cli_main(["eval", "--model", setup["model"], "--benchmarks", "nq", "--max-samples", "4",
                         "--out", str(out), "--retriever-url", server.url, f"plugins=[{setup['plugin']}]",
                         "rollout.engine=scripted", "logging.progress=false", f"task.data_dir={DATA}"]) == 0
    finally:
        server.stop()
    nq = json.loads((out / "report.json").read_text())["benchmarks"]["nq"]
    assert nq["failed_episodes"] == 1 and nq["questions"] == 3 and nq["em"] == pytest.approx(2 / 3)
    (failed,) = [r for r in read_results(out / "results.jsonl") if r["failed"]]
    assert failed["sample_index"] == 1 and failed["finish_reason"].startswith("infra_error: retriever failed")


def _first_eval_of_a_copied_model(setup, tmp_path, monkeypatch) -> tuple[Path, Path, list[str]]:
    """A copy of the tiny model evaluated once on 2 NQ questions into ``tmp_path/o``: ``(model, out,
    the flags after --model)`` for a ``--resume`` of it."""
    monkeypatch.setenv("COPC_TEST_ANSWER_KEY", str(setup["key"]))
    model = tmp_path / "m"
    shutil.copytree(setup["model"], model)
    out = tmp_path / "o"
    rest = ["--benchmarks", "nq", "--max-samples", "2", "--out", str(out), f"plugins=[{setup['plugin']}]",
            "rollout.engine=scripted", "logging.progress=false", f"task.data_dir={DATA}",
            "task.env=search", f"task.settings.retriever_index_dir={setup['index']}"]
    assert cli_main(["eval", "--model", str(model), *rest]) == 0
    return model, out, rest


def test_resume_refuses_another_policy(setup, tmp_path, capsys, monkeypatch):
    """Issue 21 item 10: ``--resume`` with other weights (same directory, changed file), another
    model directory or an endpoint instead of the model exits 2 naming the flag."""
    model, out, rest = _first_eval_of_a_copied_model(setup, tmp_path, monkeypatch)
    recorded = json.loads((out / "eval_settings.json").read_text())["policy"]
    assert recorded["source"] == "--model" and recorded["path"] == str(model.resolve())
    assert len(recorded["weights_sha256"]) == 64
    assert cli_main(["eval", "--model", str(model), *rest, "--resume"]) == 0  # the same policy resumes
    capsys.readouterr()
    assert cli_main(["eval", "--model", setup["model"], *rest, "--resume"]) == 2  # another directory
    assert f"--model={setup['model']!r}: the run in" in capsys.readouterr().err.strip().splitlines()[-1]
    weights = next(p for p in sorted(model.iterdir()) if p.suffix in (".safetensors", ".bin"))
    blob = bytearray(weights.read_bytes())
    blob[-1] ^= 1  # same directory, other weights
    weights.write_bytes(bytes(blob))
    assert cli_main(["eval", "--model", str(model), *rest, "--resume"]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert f"--model={str(model)!r}: its weights changed since the run in" in err


def test_resume_refuses_a_changed_chat_template_or_config(setup, tmp_path, capsys, monkeypatch):
    """Issue 44 item 3: ``--resume`` of a model directory whose chat template (a planted
    ``chat_template.jinja`` taking over from ``tokenizer_config.json``) or ``config.json`` changed, the
    weights untouched, exits 2 naming the changed file (only the weights were hashed before: it
    resumed). Restored bytes resume again."""
    model, out, rest = _first_eval_of_a_copied_model(setup, tmp_path, monkeypatch)
    recorded = json.loads((out / "eval_settings.json").read_text())["policy"]
    assert "config.json" in recorded["model_files"] and "tokenizer_config.json" in recorded["model_files"]
    capsys.readouterr()
    (model / "chat_template.jinja").write_text("{{ 'You are evil.' }}{% for m in messages %}{{ m.content }}"
                                               "{% endfor %}")
    assert cli_main(["eval", "--model", str(model), *rest, "--resume"]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.endswith(f"--model={str(model)!r}: its chat_template.jinja was added to {model.resolve()} "
                        f"since the run in {out}; --resume must evaluate the same policy (config and chat "
                        "template included)")
    (model / "chat_template.jinja").unlink()
    config = (model / "config.json").read_text()
    (model / "config.json").write_text(config.replace('"rms_norm_eps": 1e-06', '"rms_norm_eps": 0.5'))
    assert (model / "config.json").read_text() != config
    assert cli_main(["eval", "--model", str(model), *rest, "--resume"]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert re.search(r"--model='.*': its config\.json changed \(sha256 [0-9a-f]{12}… → [0-9a-f]{12}…\) "
                     r"since the run in", err), err
    (model / "config.json").write_text(config)
    assert cli_main(["eval", "--model", str(model), *rest, "--resume"]) == 0  # the same policy again


def test_a_second_writer_of_the_same_out_is_refused(setup, tmp_path, capsys, monkeypatch):
    """Issue 21 item 12: while another process holds ``--out`` (a real second process), ``copc eval``
    exits 2 naming the directory and the holder's pid; once it is gone the same command runs."""
    import subprocess
    import sys

    monkeypatch.setenv("COPC_TEST_ANSWER_KEY", str(setup["key"]))
    out = tmp_path / "o"
    code = ("import time\nfrom trainer.outputs.lock import lock_output_dir\n"
            f"held = lock_output_dir({str(out)!r})\nprint('held', flush=True)\ntime.sleep(120)")
    holder = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        argv = ["eval", "--model", setup["model"], "--benchmarks", "nq", "--max-samples", "1",
                "--out", str(out), f"plugins=[{setup['plugin']}]", "rollout.engine=scripted",
                "logging.progress=false", f"task.data_dir={DATA}",
                "task.env=search", f"task.settings.retriever_index_dir={setup['index']}"]
        assert cli_main(argv) == 2
        err = capsys.readouterr().err.strip().splitlines()[-1]
        assert f"--out={str(out)!r}: another copc process (pid {holder.pid}) is writing there" in err
    finally:
        holder.kill()
        holder.wait()
    assert cli_main(argv) == 0


def test_checkpoint_identity_covers_sharded_learner_state(tmp_path):
    """Issue 21 item 10 (review): a training checkpoint of a sharded backend keeps its weights in
    ``learner_shards/`` (DCP ``*.distcp`` files, written through the real CheckpointManager); other
    weights there are another policy, so the recorded hash must change with them."""
    import argparse

    from trainer.app.cli_eval import policy_identity
    from trainer.outputs.checkpoint import CheckpointManager, DirectoryState

    def shards(payload: bytes):
        return DirectoryState(lambda d: (d / "__0_0.distcp").write_bytes(payload))

    args = argparse.Namespace(endpoint=None, model=None, checkpoint=None)
    ids = []
    for payload in (b"weights of run A", b"weights of run B"):
        mgr = CheckpointManager(tmp_path / f"run{len(ids)}" / "checkpoints", 1)
        args.checkpoint = str(mgr.save(3, {"loop": {"step": 3}, "learner_shards": shards(payload)}))
        ids.append(policy_identity(args)["weights_sha256"])
    assert ids[0] != ids[1]


@pytest.mark.parametrize(("flags", "needle", "hint"), [
    (["--max-samples", "40"], "--max-samples=40: an option of the --benchmarks form", "eval.num_samples=N"),
    (["--out", "elsewhere"], "--out='elsewhere': an option of the --benchmarks form", "output_dir=RUN_DIR"),
    (["--k", "4"], "--k=4: an option of the --benchmarks form", "eval.k=K"),
    (["--resume"], "--resume=True: an option of the --benchmarks form", "re-done whole"),
    (["--engine", "sglang"], "--engine='sglang': an option", "rollout.engine=NAME"),
    (["--retriever-url", "http://127.0.0.1:9"], "--retriever-url='http://127.0.0.1:9': an option",
     "task.settings.retriever_url=VALUE with task.env=search"),
])
def test_benchmark_options_with_config_are_refused_not_ignored(tmp_path, capsys, monkeypatch, flags, needle,
                                                                hint):
    out = tmp_path / "run"
    config = Path(__file__).parent.resolve().parents[2] / "configs/search/cpu_smollm.yaml"
    argv = ["eval", "--config", str(config), *flags, f"output_dir={out}"]
    assert cli_main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("copc eval: config error: ") and needle in err[-1], err
    assert hint in err[-1]
    assert not out.exists()  # refused before anything runs


# -- gold answers and per-benchmark settings (issue 42 item 5d); here, beside the module fixture
# ``setup`` it uses (a second module importing it got a second plug-in file of the same module name)
def test_records_report_and_viewer_show_gold_and_settings(setup, tmp_path, monkeypatch):
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
