"""Issue 44 item 6 (review): ``copc view`` on a crafted run folder writes no file outside it.

The page is written to ``DIR/view.html`` by default; a crafted run folder can hold a symlink
there. Before, ``write_text`` followed it and replaced the link's target (any file the user can
write, e.g. a shell start-up file) with the page; now the link itself is replaced."""

from __future__ import annotations

import json
import subprocess
import sys


def test_view_replaces_a_planted_view_html_symlink_not_its_target(tmp_path):
    """A ``view.html`` symlink in the run folder: the target keeps its bytes, the folder gets a
    regular ``view.html`` holding the page."""
    run = tmp_path / "run"
    (run / "eval").mkdir(parents=True)
    record = {"benchmark": "b", "reward": 1.0, "finish_reason": "stop", "prompt": "p",
              "turns_text": [{"action": "a", "observation": "o"}]}
    (run / "eval" / "held_out.jsonl").write_text(json.dumps(record) + "\n")
    victim = tmp_path / "victim.txt"
    victim.write_text("the user's own file\n")
    (run / "view.html").symlink_to(victim)
    res = subprocess.run([sys.executable, "-m", "trainer.cli", "view", str(run)],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert victim.read_text() == "the user's own file\n"
    page = run / "view.html"
    assert not page.is_symlink() and page.is_file()
    assert page.read_text(encoding="utf-8").startswith("<!DOCTYPE html>")
    assert [p.name for p in run.iterdir() if p.name.endswith(".tmp")] == []
