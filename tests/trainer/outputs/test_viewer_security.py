"""``copc view`` against a crafted run folder and a hostile local client (issue 44, item 4):

* every field of a crafted run folder (samples and held-out records: ``step``, ``cut_tokens``,
  ``sample_id``, the finish reason, the prompt, tokens, turns, answers, meta values) is drawn as
  text in headless Chromium: no element of the payload is created, no script of it runs;
* ``copc view --serve`` (a real server on 127.0.0.1, real HTTP clients) serves the page and
  nothing else (no other file of the run directory, no listing), and refuses a foreign ``Host``
  (DNS rebinding) with 403.
"""

from __future__ import annotations

import json
import queue
import re
import signal
import subprocess
import sys
import threading

import httpx

from .test_viewer import dom, needs_chromium


def payload(name: str) -> str:
    """Markup that, if inserted as HTML, runs a script marking the body with ``name``."""
    return (f'<img src=x onerror="document.body.dataset.pwned=\'{name}\'">'
            f'<svg onload="document.body.dataset.pwned=\'{name}\'"></svg>')


def crafted_run(root) -> None:
    """A run folder whose every field is markup: one training sample, one held-out record."""
    (root / "samples").mkdir(parents=True)
    sample = {"step": payload("step"), "sample_id": payload("sid"), "reward": 0.25,
              "finish_reason": payload("finish"), "prompt": payload("prompt"),
              "tokens": [payload("tok"), "b"], "loss_mask": [1, 1], "advantage": [0.5, -0.5],
              "ratio": [1.0, 3.0], "cut_tokens": payload("cut"), "turns": payload("turns"),
              "tool_calls": 2, "policy_interval": [0.5, 2.0], "advantage_interval": [0.8, 1.2]}
    (root / "samples" / "step_1.jsonl").write_text(json.dumps(sample) + "\n")
    record = {"benchmark": payload("bench"), "reward": 1.0, "finish_reason": payload("efinish"),
              "prompt": payload("eprompt"), "answer": payload("answer"), "gold": [payload("gold"), "x"],
              "correct": True, "turns_text": [{"action": payload("action"), "observation": payload("obs")}],
              "sample_id": payload("esid"), "llm_s": payload("llm")}
    (root / "eval").mkdir()
    (root / "eval" / "held_out.jsonl").write_text(json.dumps(record) + "\n")
    (root / "secret.txt").write_text("do not serve me\n")


@needs_chromium
def test_a_crafted_run_folder_is_drawn_as_text(tmp_path):
    run = tmp_path / "run"
    crafted_run(run)
    page = tmp_path / "view.html"
    res = subprocess.run([sys.executable, "-m", "trainer.cli", "view", str(run), "--out", str(page)],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    for overlay in ("mask", "masked"):
        html = dom(page.as_uri() + f"#open=all&overlay={overlay}")  # every episode opened and drawn
        assert "data-pwned" not in html  # no script of the payload ran
        assert "<img" not in html and "<svg" not in html  # no element of the payload was created
        shown = set(re.findall(r"dataset\.pwned='(\w+)'", html))  # the payloads, drawn as text
        assert shown >= {"step", "sid", "finish", "prompt", "tok", "cut", "bench", "efinish", "eprompt",
                         "answer", "gold", "action", "obs", "esid"}, shown


def test_serve_serves_the_page_only_and_checks_host(tmp_path):
    run = tmp_path / "run"
    crafted_run(run)
    proc = subprocess.Popen([sys.executable, "-m", "trainer.cli", "view", str(run), "--serve", "--port", "0"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        lines: queue.Queue = queue.Queue()
        threading.Thread(target=lambda: [lines.put(x) for x in proc.stdout], daemon=True).start()
        url = None
        while url is None:
            m = re.search(r"serving (http://127\.0\.0\.1:\d+)/view\.html", lines.get(timeout=120))
            url = m.group(1) if m else None
        port = url.rsplit(":", 1)[1]
        page = (run / "view.html").read_bytes()
        for path in ("/samples/step_1.jsonl", "/samples/", "/eval/held_out.jsonl", "/secret.txt",
                     "/../run/secret.txt", "/%2e%2e/secret.txt", "/view.html/", "//etc/passwd"):
            r = httpx.get(url + path)
            assert r.status_code == 404 and b"secret" not in r.content and b"<a href" not in r.content, path
        for path in ("/view.html", "/", "/view.html?x=1#open=all"):
            r = httpx.get(url + path)
            assert r.status_code == 200 and r.content == page, path
            assert "script-src 'sha256-" in r.headers["content-security-policy"]
            assert r.headers["x-content-type-options"] == "nosniff"
        for host in (f"localhost:{port}", "localhost", f"127.0.0.1:{port}"):
            assert httpx.get(url + "/view.html", headers={"Host": host}).status_code == 200, host
        for host in (f"evil.example:{port}", "rebind.attacker.test", f"127.0.0.1.evil.example:{port}",
                     f"localhost:{int(port) + 1}"):
            r = httpx.get(url + "/view.html", headers={"Host": host})
            assert r.status_code == 403 and page not in r.content, host
            assert repr(host) in r.text
    finally:
        proc.send_signal(signal.SIGINT)
        assert proc.wait(30) == 0
