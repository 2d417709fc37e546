"""The README's "Add your own tool environment" section runs as written: the environment file, the
try-it-and-write-data block, and ``copc train`` on the example config (a few RL steps, from a
temporary working directory, writing ``summary.json``)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import environments

REPO = Path(__file__).resolve().parents[2]
README = REPO / "README.md"


def _blocks() -> list[tuple[str, str]]:
    text = README.read_text(encoding="utf-8")
    section = text.split("<!-- section: environments -->", 1)[1].split("<!-- section:", 1)[0]
    return re.findall(r"```(python|bash)\n(.*?)```", section, re.DOTALL)


def _copc() -> list[str]:
    """The ``copc`` console script of the interpreter running the tests."""
    script = Path(sys.executable).parent / "copc"
    return [str(script)] if script.exists() else [sys.executable, "-m", "trainer.cli"]


def test_readme_example_runs_and_trains(tmp_path, monkeypatch):
    blocks = _blocks()
    assert [lang for lang, _ in blocks] == ["python", "python", "bash"]
    (_, env_code), (_, try_code), (_, command) = blocks
    first_line = env_code.splitlines()[0]
    assert first_line == "# calc_env.py"
    (tmp_path / "calc_env.py").write_text(env_code)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        exec(compile(try_code, "README.md[environments, block 2]", "exec"), {})
        assert "calc" in environments.names()
    finally:
        environments.unregister("calc")
        sys.modules.pop("calc_env", None)

    train = [json.loads(x) for x in (tmp_path / "calc_data/train.jsonl").read_text().splitlines()]
    held = [json.loads(x) for x in (tmp_path / "calc_data/eval.jsonl").read_text().splitlines()]
    assert (len(train), len(held)) == (154, 8)  # 9 x 9 x 2 questions, 8 held out
    assert not {r["question"] for r in train} & {r["question"] for r in held}
    assert all(str(eval(r["question"])) == r["answer"] for r in train + held)

    # the command as written, from the directory holding calc_env.py and calc_data/
    # (configs/ there is the repository's; `copc` is this interpreter's console script)
    argv = command.strip().splitlines()[0].split("#")[0].split()
    assert argv == ["copc", "train", "--config", "configs/examples/calc_tiny.yaml"]
    (tmp_path / "configs").symlink_to(REPO / "configs")
    res = subprocess.run([*_copc(), *argv[1:], "logging.progress=false"], cwd=tmp_path,
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-4000:]
    out = tmp_path / "runs" / "calc_tiny"
    summary = json.loads((out / "summary.json").read_text())
    assert summary["task"] == "calc_env.py:calc"
    assert summary["steps"] == 3 and summary["duplicate_trained_uids"] == 0
    assert summary["trained_uids"] == 12  # 3 steps x 4 prompts x 1 sample
    for phase in ("eval_before", "eval_after"):
        assert summary[phase]["n"] == 8.0 and summary[phase]["infra_failed"] == 0.0, summary[phase]
        assert 0.0 <= summary[phase]["accuracy"] <= 1.0
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "actor/pg_loss" in r] == [1, 2, 3]
    shutil.rmtree(out / "checkpoints", ignore_errors=True)


def test_readme_mcp_example_runs_as_written(tmp_path, monkeypatch):
    """The README's MCP snippet, with ``calc_server.py`` the test suite's MCP server (stdio)."""
    text = README.read_text(encoding="utf-8")
    section = text.split("<!-- section: network -->", 1)[1].split("<!-- section:", 1)[0]
    [code] = re.findall(r"```python\n(.*?)```", section, re.DOTALL)
    shutil.copy(Path(__file__).with_name("mcp_calc_server.py"), tmp_path / "calc_server.py")
    monkeypatch.chdir(tmp_path)
    scope: dict = {}
    exec(compile(code.replace('"python"', repr(sys.executable)), "README.md", "exec"), scope)
    assert scope["reward"] == 1.0 and scope["done"] is True
    assert "add" in json.dumps(scope["info"]["tools"])  # the server's tools, with their schemas


def test_readme_env_refuses_a_misspelt_setting_naming_the_nearest(tmp_path, monkeypatch):
    """The README's environment declares its settings as parameters, so ``copc train`` refuses a
    misspelt ``task.env_kwargs`` key at load, naming the nearest valid one (issue 42 item 5c)."""
    (_, env_code), _, _ = _blocks()
    (tmp_path / "calc_env.py").write_text(env_code)
    data = tmp_path / "calc_data"
    data.mkdir()
    rows = [{"question": f"{a} + 1", "answer": str(a + 1)} for a in range(10)]
    (data / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    monkeypatch.chdir(tmp_path)
    (tmp_path / "configs").symlink_to(REPO / "configs")
    res = subprocess.run([*_copc(), "train", "--config", "configs/examples/calc_tiny.yaml",
                          "task.eval_data=[]", "task.env_kwargs={promt_template: 'Q: {question}'}"],
                         cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert res.returncode == 2, res.stderr[-3000:]
    assert res.stderr.strip().splitlines()[-1] == (
        "copc train: config error: task.env_kwargs.promt_template: not a setting of env "
        "'calc'; did you mean prompt_template? (its settings: prompt_template)")
    assert not list((tmp_path / "runs" / "calc_tiny").glob("checkpoints/step_*"))
    # the setting spelt right reaches the environment
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        environments.resolve("calc_env.py:calc")
        env = environments.make("calc", prompt_template="Q: {question}")
        obs, _ = env.reset(options={"sample": {"question": "6 * 7", "answer": "42"}})
        assert obs == "Q: 6 * 7"
    finally:
        environments.unregister("calc")
        sys.modules.pop("calc_env", None)
