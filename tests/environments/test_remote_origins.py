"""A web page served by another local process cannot drive ``copc env serve`` (issue 44, item 4),
in headless Chromium against a real server on 127.0.0.1.

The page (served by a plain ``http.server`` on another port of 127.0.0.1, as ``copc view --serve``
or a notebook would serve one) posts a ``/reset`` (a ``no-cors`` ``text/plain`` POST: no CORS
preflight) and opens ``ws://127.0.0.1:PORT/ws`` to reset an episode. Without a token the server
refuses both (403: the page's ``Origin`` is neither its own nor configured) and opens no session;
a server started with ``--allow-origin`` of that page serves it (the browser check can see success).
"""

from __future__ import annotations

import functools
import http.server
import json
import queue
import shutil
import subprocess
import sys
import threading
import urllib.parse

import httpx
import pytest

from environments.remote.launch import start_env_server

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="needs Debian's chromium (apt-get install chromium)")

SAMPLE = {"id": "m1", "problem": "What is 12 * 34?", "answer": "408"}
PAGE = """<!DOCTYPE html><html><body><script>
const ENV = "127.0.0.1:ENV_PORT", out = {};
function done(){fetch("/report?" + encodeURIComponent(JSON.stringify(out)));}
function ws(){const s = new WebSocket("ws://" + ENV + "/ws");
  s.onopen = () => s.send(JSON.stringify({type: "reset", data: {sample: SAMPLE}}));
  s.onmessage = e => {out.ws = JSON.parse(e.data).type; s.close(); done();};
  s.onerror = () => {out.ws = "error"; done();};}
fetch("http://" + ENV + "/reset", {method: "POST", mode: "no-cors", headers: {"Content-Type": "text/plain"},
  body: JSON.stringify({sample: SAMPLE})}).then(() => {out.fetch = "sent";},
  () => {out.fetch = "error";}).finally(ws);
</script></body></html>
"""


class PageHandler(http.server.SimpleHTTPRequestHandler):
    """Serves the page; ``GET /report?<json>`` is what the page's script saw (kept in ``reports``)."""

    reports: queue.Queue = queue.Queue()

    def do_GET(self) -> None:
        if self.path.startswith("/report?"):
            self.reports.put(json.loads(urllib.parse.unquote(self.path.split("?", 1)[1])))
            self.send_response(204)
            self.end_headers()
            return
        super().do_GET()

    def log_message(self, *args) -> None:
        pass


@pytest.fixture(scope="module")
def page_server(tmp_path_factory):
    """Another local process's web server: it serves the hostile page."""
    root = tmp_path_factory.mktemp("page")
    handler = functools.partial(PageHandler, directory=str(root))
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield root, srv.server_address[1]
    srv.shutdown()


def run_page(root, page_port: int, env_url: str) -> dict:
    """Load the page in headless Chromium; what its script saw (``{}`` if it reported nothing in
    60 s)."""
    env_port = env_url.rsplit(":", 1)[1]
    (root / "page.html").write_text(PAGE.replace("ENV_PORT", env_port).replace("SAMPLE", json.dumps(SAMPLE)))
    proc = subprocess.Popen([CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu",
                             "--remote-debugging-port=0", f"--user-data-dir={root / 'profile'}",
                             f"http://127.0.0.1:{page_port}/page.html"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        return PageHandler.reports.get(timeout=60)
    except queue.Empty:
        return {}
    finally:
        proc.kill()
        proc.wait(30)


def test_a_page_of_another_local_server_cannot_drive_the_env_server(page_server):
    root, page_port = page_server
    srv = start_env_server("math_tool", extra_args=("--sandbox-workers", "1"))
    try:
        seen = run_page(root, page_port, srv.url)
        assert httpx.get(f"{srv.url}/sessions").json()["opened_total"] == 0, seen  # nothing was opened
        assert seen == {"fetch": "sent", "ws": "error"}, seen  # the handshake was refused
    finally:
        srv.stop()


def test_a_configured_origin_is_served(page_server):
    root, page_port = page_server
    srv = start_env_server("math_tool", extra_args=("--sandbox-workers", "1",
                                                    "--allow-origin", f"http://127.0.0.1:{page_port}"))
    try:
        seen = run_page(root, page_port, srv.url)
        assert seen == {"fetch": "sent", "ws": "observation"}, seen
        assert httpx.get(f"{srv.url}/sessions").json()["opened_total"] >= 1
    finally:
        srv.stop()


def test_a_malformed_origin_setting_is_one_line():
    res = subprocess.run([sys.executable, "-m", "trainer.cli", "env", "serve", "--env", "math_tool",
                          "--allow-origin", "http://x/path"],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 2
    assert res.stderr.strip().splitlines()[-1].endswith(
        "--allow-origin='http://x/path': must be an origin, http(s)://host[:port] (no path)"), res.stderr
