"""``gsm8k_solutions`` warm-start traces (issue 45 item 1): GSM8K training solutions turned into one
ReTool ``<code>`` call each and played through the REAL ``MathToolEnv`` and sandbox; rows whose last
calculation is not the answer give no trace and are counted; through the task, held-out problems are
never used and the traces are seeded."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import environments
from environments.sandbox import Sandbox, SandboxConfig
from trainer.config import ConfigError, WarmStartConfig, load_config
from trainer.config.specs import task_spec
from trainer.tasks import build_task
from trainer.tasks.math_tool.gsm8k import gsm8k_code, gsm8k_traces

DATA = Path(__file__).resolve().parents[3] / "data"
ROWS = [json.loads(x) for x in (DATA / "gsm8k_train.jsonl").read_text().splitlines()[:60]]


def test_the_program_of_a_solution_is_its_sentences_and_annotations():
    assert gsm8k_code(ROWS[0]["solution"]) == (
        "# Natalia sold 48/2 = 24 clips in May.\nprint(48/2)\n"
        "# Natalia sold 48+24 = 72 clips altogether in April and May.\nprint(48+24)")
    assert gsm8k_code(ROWS[29]["solution"]) is None  # algebra in words: no calculator annotation
    assert gsm8k_code("It is 2^3 = <<2^3=8>>8.\n#### 8") is None  # ^ would be XOR in Python
    assert gsm8k_code("No calculation here.\n#### 3") is None


@pytest.fixture(scope="module")
def sandbox():
    sb = Sandbox(SandboxConfig(workers=1))
    yield sb
    sb.close()


def test_traces_are_played_through_the_sandbox_and_wrong_last_values_are_counted(sandbox):
    """Rows 0-59: 6 give no trace (row 29 has no program; rows 23, 32, 44, 48, 53 end on a
    calculation that is not the answer, e.g. row 23's ``75-55`` = 20 for the answer 5), 54 do; each
    trace runs the program, gets the sandbox's real output, and copies its last line."""
    traces, skipped = gsm8k_traces(ROWS, lambda: environments.make("math_tool", sandbox=sandbox,
                                                                   prompt_template="{problem}"))
    assert (len(traces), skipped) == (54, 6)
    first = traces[0]
    assert first.prompt == ROWS[0]["problem"]
    assert first.pieces == [
        ("action", "<code>\n```python\n" + gsm8k_code(ROWS[0]["solution"]) + "\n```\n</code>"),
        ("observation", "\n<interpreter>\n24.0\n72\n</interpreter>\n"),
        ("action", "The answer is $\\boxed{72}$.")]
    assert traces[1].pieces[-1] == ("action", "The answer is $\\boxed{10.0}$.")  # 0.2*50 printed
    assert ROWS[23]["problem"] not in {t.prompt for t in traces}


def test_the_task_makes_seeded_traces_and_never_uses_held_out_problems(tmp_path):
    """Through ``MathToolTask.warm_start_traces`` with ``warm_start.kind: gsm8k_solutions``: held-out
    problems (here GSM8K *training* rows held out on purpose) never appear; the same seed gives the
    same traces; another kind's name is refused in one line."""
    held = tmp_path / "held.jsonl"
    held.write_text("".join(json.dumps(r) + "\n" for r in ROWS[:40]))
    cfg = load_config(None, ["task.env=math_tool", "task.train_data=[gsm8k_train]",
                             f"task.eval_data=[{held}]", "task.env_kwargs={reward: {mode: dapo_strict}}",
                             "eval.num_samples=40"])
    ws = WarmStartConfig(enabled=True, kind="gsm8k_solutions", num_examples=12, seed=3)
    with build_task(task_spec(cfg)) as task:
        traces = task.warm_start_traces(ws, progress=False)
        assert len(traces) == 12 and traces == task.warm_start_traces(ws, progress=False)
        prompts = " ".join(t.prompt for t in traces)
        assert not any(r["problem"] in prompts for r in ROWS[:40])
        assert all(t.pieces[0][1].startswith("<code>\n```python\n# ") for t in traces)
        with pytest.raises(ConfigError, match=r"warm_start.kind='search_r1': the task of env 'math_tool' "):
            task.warm_start_traces(WarmStartConfig(enabled=True, kind="search_r1"), progress=False)
