"""Sessions of ``copc env serve``: 256 concurrent sessions x 4 steps with no error and no leaked
session; a client killed mid-episode frees its session within the idle timeout; idle sessions
expire (WebSocket and HTTP); at ``--max-sessions`` a new session is refused with 503."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

import environments
from environments.errors import InfrastructureError
from environments.remote.launch import REPO, start_env_server
from environments.search import load_qa

MATH = {"id": "m1", "problem": "What is 12 * 34?", "answer": "408"}
IDLE_S = 3.0


def active(url: str) -> int:
    return httpx.get(f"{url}/sessions").json()["active_sessions"]


def search_turns(row: dict) -> list[str]:
    gold = row["golden_answers"][0]
    return ["hmm, let me think", f"<search>{row['question']}</search>", f"<search>{gold}</search>",
            f"<answer>{gold}</answer>"]


@pytest.mark.slow
def test_256_concurrent_sessions_4_steps_no_errors_no_leaks(retriever_url):
    n = 256
    rows = load_qa("hotpotqa", limit=32)
    local = environments.make("search", retriever_url=retriever_url)
    expected = {}
    for row in rows:  # the in-process episode of each row, for exact comparison
        obs, info = local.reset(options={"sample": row})
        expected[row["id"]] = [(obs, info)] + [local.step(t) for t in search_turns(row)]
    local.close()
    server = start_env_server("search", f"retriever_url={retriever_url}",
                              extra_args=("--max-sessions", str(n)))
    all_open = threading.Barrier(n + 1, timeout=300)
    go = threading.Barrier(n + 1, timeout=300)

    def episode(i: int) -> list[tuple]:
        row = rows[i % len(rows)]
        env = environments.make("remote", url=server.url)
        try:
            out = [env.reset(options={"sample": row})]
            all_open.wait()
            go.wait()
            out += [env.step(t) for t in search_turns(row)]
            assert env.session_id is None  # closed by the terminal step
            return out
        finally:
            env.close()

    try:
        with ThreadPoolExecutor(n) as pool:
            futures = [pool.submit(episode, i) for i in range(n)]
            all_open.wait()
            assert active(server.url) == n  # every session open at once
            go.wait()
            results = [f.result() for f in futures]  # re-raises any episode's error
        assert len(results) == n
        for i, got in enumerate(results):
            assert got == expected[rows[i % len(rows)]["id"]]
        assert active(server.url) == 0
        stats = httpx.get(f"{server.url}/sessions").json()
        assert stats["opened_total"] == n and stats["expired_total"] == 0
    finally:
        server.stop()


@pytest.fixture(scope="module")
def small_server():
    """math_tool with 2 sessions at most and a 3 s idle timeout."""
    server = start_env_server("math_tool", extra_args=("--max-sessions", "2", "--idle-timeout", str(IDLE_S)))
    yield server
    server.stop()


CLIENT = """
import sys, time
import environments
env = environments.make("remote", url=sys.argv[1])
env.reset(options={"sample": {"id": "k", "problem": "1+1?", "answer": "2"}})
obs = env.step("<code>print(1+1)</code>")[0]
print("ready", obs == "\\n<interpreter>\\n2\\n</interpreter>\\n", flush=True)
time.sleep(600)
"""


def test_client_killed_mid_episode_frees_its_session(small_server):
    proc = subprocess.Popen([sys.executable, "-c", CLIENT, small_server.url], cwd=REPO,
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "ready True"
        assert active(small_server.url) == 1
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        t0 = time.monotonic()
        while active(small_server.url):
            assert time.monotonic() - t0 < IDLE_S, "the killed client's session outlived the idle timeout"
            time.sleep(0.05)
    finally:
        proc.kill()
        proc.wait()
    assert httpx.get(f"{small_server.url}/sessions").json()["expired_total"] == 0  # freed on disconnect


def test_idle_sessions_expire(small_server):
    url = small_server.url
    env = environments.make("remote", url=url)
    env.reset(options={"sample": MATH})
    sid = httpx.post(f"{url}/reset", json={"sample": MATH}).json()["metadata"]["session_id"]
    assert active(url) == 2
    before = httpx.get(f"{url}/sessions").json()["expired_total"]
    time.sleep(IDLE_S + 1.5)
    stats = httpx.get(f"{url}/sessions").json()
    assert (stats["active_sessions"], stats["expired_total"] - before) == (0, 2)
    with pytest.raises(InfrastructureError, match=r"IDLE_TIMEOUT|the session is gone"):
        env.step("<code>print(1)</code>")
    r = httpx.post(f"{url}/step", json={"session_id": sid, "action": {"text": "x"}})
    assert r.status_code == 404 and r.json()["field"] == "session_id"
    env.close()


def test_capacity_is_bounded_and_refusals_are_503(small_server):
    url = small_server.url
    envs = [environments.make("remote", url=url, retries=1, backoff_s=0.05) for _ in range(3)]
    try:
        for env in envs[:2]:
            env.reset(options={"sample": MATH})
        refused = r"reset failed after 2 attempts: CAPACITY_REACHED: all 2 sessions are in use"
        with pytest.raises(InfrastructureError, match=refused):
            envs[2].reset(options={"sample": MATH})
        r = httpx.post(f"{url}/reset", json={"sample": MATH})
        assert r.status_code == 503 and r.json()["code"] == "CAPACITY_REACHED"
        envs[0].close()
        deadline = time.monotonic() + 10
        while active(url) > 1:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        assert "12 * 34" in envs[2].reset(options={"sample": MATH})[0]
    finally:
        for env in envs:
            env.close()
