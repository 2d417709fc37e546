"""Issue 44 item 6 (review) of ``copc view``, with real files and a real server on 127.0.0.1:

* on a crafted run folder it writes no file outside it: the page is written to ``DIR/view.html``
  by default, and a crafted folder can hold a symlink there. Before, ``write_text`` followed it and
  replaced the link's target (any file the user can write, e.g. a shell start-up file) with the
  page; now the link itself is replaced;
* ``--serve`` closes connections that send nothing (before, each held a server thread forever:
  200 silent connections were 200 threads).
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading
import time

import httpx

from trainer.outputs.viewer.serve import IDLE_TIMEOUT_S, make_server


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


def test_served_page_closes_silent_connections(tmp_path):
    """Connections that never send a request are closed after ``IDLE_TIMEOUT_S`` (10 s); the page
    is served meanwhile and afterwards."""
    page = tmp_path / "view.html"
    page.write_text("<!DOCTYPE html><p>page</p>\n")
    srv = make_server(page, 0)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    port = srv.server_address[1]
    silent = [socket.create_connection(("127.0.0.1", port), timeout=5) for _ in range(20)]
    try:
        url = f"http://127.0.0.1:{port}/view.html"
        assert httpx.get(url).status_code == 200
        time.sleep(IDLE_TIMEOUT_S + 1.5)
        closed = 0
        for s in silent:
            s.settimeout(2)
            try:
                closed += s.recv(1) == b""
            except ConnectionResetError:
                closed += 1
            except TimeoutError:
                pass
        assert closed == len(silent), f"{len(silent) - closed} silent connections still open"
        assert httpx.get(url).status_code == 200
    finally:
        for s in silent:
            s.close()
        srv.shutdown()
        srv.server_close()
