"""``copc train`` with its output in files (not a terminal): progress is one line per RL step and
per phase (no carriage-return redraws, no final bar frame) and the report table keeps each cell
on one line (issue 42 item 5e). A real tiny run: warm-start, held-out evaluation, 2 RL steps."""

from __future__ import annotations

import re
import subprocess
import sys

ARGS = ["output_dir={out}", "train.total_steps=2", "train.prompts_per_step=2", "train.micro_batch_size=4",
        "warm_start.steps=5", "warm_start.num_examples=20", "eval.num_samples=4", "eval.k=1",
        "rollout.max_new_tokens=12", "model.tiny.hidden_size=32", "model.tiny.intermediate_size=64",
        "model.tiny.num_layers=1", "logging.progress=true"]


def test_train_output_to_files_is_one_line_per_step_and_phase(tmp_path):
    out, err = tmp_path / "out.txt", tmp_path / "err.txt"
    with out.open("w") as fo, err.open("w") as fe:
        args = [a.format(out=tmp_path / "run") for a in ARGS]
        rc = subprocess.run([sys.executable, "-m", "trainer.cli", "train", "--config",
                             "configs/math_tool/cpu_tiny.yaml", *args],
                            stdout=fo, stderr=fe, timeout=300).returncode
    stdout, stderr = out.read_text(), err.read_text()
    assert rc == 0, stderr[-3000:]
    assert "\r" not in stdout and "\r" not in stderr
    rl = [line for line in stdout.splitlines() if re.match(r"RL (\d|━)", line)]
    assert [line.split(" elapsed ")[0] for line in rl] == ["RL 1/2", "RL 2/2"]  # no final bar frame
    assert all(re.search(r" ETA \S+ reward \d\.\d{3} acc ", line) for line in rl)
    phases = [line for line in stderr.splitlines() if re.match(r"^[\w -]+: \d+/\d+ in \d+\.\d s", line)]
    assert [p.split(" in ")[0] for p in phases] == ["retool traces: 12/12", "direct-answer traces: 8/8",
                                                   "sft warm-start: 5/5", "eval before_rl: 4/4",
                                                   "eval after_rl: 4/4"]
    assert re.search(r"^sft warm-start: 5/5 in \d+\.\d s \(loss \d+\.\d{3}\)$", stderr, re.M)
    # the table's cells on one line each: the accuracy row holds both values with their intervals
    row = next(line for line in stdout.splitlines() if line.startswith("│ accuracy "))
    cells = [c.strip() for c in row.strip("│").split("│")]
    assert len(cells) == 4 and all(re.fullmatch(r"\d\.\d{3} \[\d\.\d{3}, \d\.\d{3}\]", c) for c in cells[1:3])
    assert re.fullmatch(r"[+-]\d\.\d{3} \[[+-]\d\.\d{3}, [+-]\d\.\d{3}\] \(n=4\)", cells[3])
    assert "Δ after − before (paired)" in stdout  # the header cell unwrapped too
