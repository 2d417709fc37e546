"""Issue 44 item 1, against the real bubblewrap sandbox: nothing of one call reaches the next, in
memory either. Call 1 puts unique secrets in its source, its environment and its output; call 2
on the same worker searches its own frames (up into whatever forked it), every object the
garbage collector tracks and all its readable anonymous memory for anything shaped like them.
Before the zygote, the fork server still held call 1's request and reply when it forked call 2:
all three searches found them."""

from __future__ import annotations

import json
import secrets

import pytest

from environments.sandbox import Sandbox, SandboxConfig

# What the secrets look like: call 2's own source holds no text of that shape ("L[E]AK" is not).
PATTERN = r"L[E]AK-[0-9a-f]{32}"

# Call 1: the source secret is a literal; the environment and output secrets exist only at run
# time (reversed from the source), so each reaches memory through its own path.
CALL_1 = """
import os
source_secret = "{src}"
os.environ["COPC_CALL_SECRET"] = "{env_rev}"[::-1]
print("{out_rev}"[::-1], flush=True)
"""

CALL_2 = r"""
import ctypes, gc, json, re, sys
pat = re.compile(rb"PATTERN")
found = {"frames": set(), "gc": set(), "memory": set()}

def scan(kind, value):
    if isinstance(value, str):
        value = value.encode("utf-8", "surrogatepass")
    if isinstance(value, (bytes, bytearray)):
        found[kind].update(m.decode() for m in pat.findall(value))

frame = sys._getframe()
while frame is not None:  # this program's frames, then whatever called exec in this process
    for name, value in list(frame.f_locals.items()):
        scan("frames", name)
        scan("frames", repr(value)[:1_000_000])
    frame = frame.f_back
gc.unfreeze()
for obj in gc.get_objects():
    for ref in gc.get_referents(obj):
        scan("gc", ref)
for line in open("/proc/self/maps").read().splitlines():
    fields = line.split()
    start, end = (int(x, 16) for x in fields[0].split("-"))
    path = fields[5] if len(fields) > 5 else ""
    if fields[1][0] != "r" or path not in ("", "[heap]", "[stack]") or end - start > 1 << 30:
        continue
    scan("memory", ctypes.string_at(start, end - start))
print(json.dumps({k: sorted(v) for k, v in found.items()}))
""".replace("PATTERN", PATTERN)


@pytest.fixture(scope="module")
def one_worker():
    """A 1-worker bwrap pool: call 2 runs on the worker that ran call 1."""
    with Sandbox(SandboxConfig(workers=1, timeout_s=30)) as sb:
        yield sb


def test_next_call_finds_nothing_of_the_previous_one(one_worker):
    """Call 2's frames, gc objects and readable memory hold none of call 1's secrets."""
    src, env, out = (f"LEAK-{secrets.token_hex(16)}" for _ in range(3))
    first = one_worker.run(CALL_1.format(src=src, env_rev=env[::-1], out_rev=out[::-1]))
    assert first.ok and first.stdout.strip() == out, first
    second = one_worker.run(CALL_2, timeout_s=30, memory_mb=1024)
    assert second.ok, second
    found = json.loads(second.stdout)
    assert found == {"frames": [], "gc": [], "memory": []}, (
        f"call 2 read call 1's state; secrets: source {src}, env {env}, output {out}: {found}")


def test_the_search_finds_a_secret_of_its_own_call(one_worker):
    """The search is able to find what it looks for: a secret the call itself holds (in a local,
    an object and memory) is reported by all three scans."""
    own = f"LEAK-{secrets.token_hex(16)}"
    code = f'mine = "{own[::-1]}"[::-1]\n' + CALL_2
    res = one_worker.run(code, timeout_s=30, memory_mb=1024)
    assert res.ok, res
    found = json.loads(res.stdout)
    assert found == {"frames": [own], "gc": [own], "memory": [own]}, found


def test_env_server_client_finds_nothing_of_another_clients_program():
    """Through ``copc env serve`` (one shared sandbox worker), client B's program finds nothing
    of the program client A ran in its own session just before."""
    import environments
    from environments.remote.launch import start_env_server

    server = start_env_server("math_tool", "limits.max_turns=3", extra_args=("--sandbox-workers", "1"))
    sample = {"id": "m1", "problem": "What is 12 * 34?", "answer": "408"}
    src, env, out = (f"LEAK-{secrets.token_hex(16)}" for _ in range(3))
    try:
        client_a = environments.make("remote", url=server.url, remote_env="math_tool")
        client_b = environments.make("remote", url=server.url, remote_env="math_tool")
        try:
            client_a.reset(options={"sample": sample})
            obs_a = client_a.step("<code>\n" + CALL_1.format(src=src, env_rev=env[::-1],
                                                             out_rev=out[::-1]) + "\n</code>")[0]
            assert out in obs_a, obs_a
            client_b.reset(options={"sample": sample})
            obs_b = client_b.step("<code>\n" + CALL_2 + "\n</code>")[0]
        finally:
            client_a.close()
            client_b.close()
    finally:
        server.stop()
    found = json.loads(obs_b.split("<interpreter>")[1].split("</interpreter>")[0])
    assert found == {"frames": [], "gc": [], "memory": []}, (src, env, out, found)
