"""Attacks on the real bwrap sandbox: each is contained, explained, and the pool survives."""

from __future__ import annotations

import os
import socket
import threading
import time

import pytest

from environments.sandbox import Sandbox, SandboxConfig, SandboxUnavailableError
from environments.sandbox import run as sandbox_run

from .conftest import SECRET


def assert_pool_alive(sb: Sandbox) -> None:
    r = sb.run("print(1+1)")
    assert (r.status, r.stdout, r.exit_code) == ("ok", "2\n", 0), r


def test_print_and_last_fields(sandbox):
    r = sandbox.run("import sys\nprint('a')\nprint('b', file=sys.stderr)")
    assert (r.stdout, r.stderr, r.exit_code, r.status, r.reason) == ("a\n", "b\n", 0, "ok", None)
    assert 0 < r.duration_s < 5 and r.wall_s >= r.duration_s and r.max_rss_kb > 0


def test_infinite_loop_times_out(sandbox):
    t0 = time.monotonic()
    r = sandbox.run("while True:\n    pass", timeout_s=1.0)
    assert r.status == "timeout" and "1 s" in r.reason and r.exit_code == -9
    assert 1.0 <= time.monotonic() - t0 < 4.0
    assert_pool_alive(sandbox)


def test_fork_bomb_contained(sandbox):
    code = "import os\nwhile True:\n    os.fork()"
    host_before = len(os.listdir("/proc"))
    r = sandbox.run(code, timeout_s=2.0)
    assert r.status in ("error", "timeout", "output_limit"), r
    # RLIMIT_NPROC really applies (the code runs as a non-root uid): fork fails with EAGAIN.
    assert r.status == "timeout" or "BlockingIOError" in r.stderr, r
    probe = sandbox.run(
        "import os, resource\n"
        "print(os.getuid(), resource.getrlimit(resource.RLIMIT_NPROC)[0])\n"
        "n = 0\n"
        "try:\n"
        "    for _ in range(100):\n"
        "        if os.fork() == 0:\n"
        "            import time; time.sleep(3); os._exit(0)\n"
        "        n += 1\n"
        "except OSError:\n"
        "    pass\n"
        "print(n)")
    uid, nproc, forked = (int(x) for x in probe.stdout.split())
    assert uid != 0 and nproc == 16 and forked < 16, probe
    # the sleepers were killed with the call: nothing is left on the host
    time.sleep(0.2)
    assert len(os.listdir("/proc")) < host_before + 10
    assert_pool_alive(sandbox)


def test_memory_bomb(sandbox):
    r = sandbox.run("x = []\nwhile True:\n    x.append(bytearray(50 * 1024 * 1024))")
    assert r.status == "memory_limit" and "512 MiB" in r.reason, r
    r = sandbox.run("b = bytearray(10**10)", memory_mb=256)
    assert r.status == "memory_limit" and "256 MiB" in r.reason, r
    assert_pool_alive(sandbox)


def test_deep_recursion(sandbox):
    r = sandbox.run("def f(n):\n    return f(n + 1)\nf(0)")
    assert r.status == "error" and "RecursionError" in r.reason, r
    r = sandbox.run("import sys\nsys.setrecursionlimit(10**8)\n"
                    "def f(n):\n    return f(n + 1)\nf(0)", timeout_s=2.0, memory_mb=256)
    assert r.status in ("memory_limit", "signal", "timeout", "error"), r
    assert r.reason
    assert_pool_alive(sandbox)


def test_huge_output_truncated(sandbox):
    r = sandbox.run("while True:\n    print('x' * 1000)")
    assert r.status == "output_limit" and r.truncated
    assert len(r.stdout.encode()) + len(r.stderr.encode()) <= 8192
    assert r.stdout.startswith("x" * 1000)
    assert_pool_alive(sandbox)


def test_file_size_limit(sandbox):
    r = sandbox.run("open('big', 'wb').write(b'0' * (32 * 1024 * 1024))")
    assert r.status == "file_size_limit", r
    assert_pool_alive(sandbox)


def test_write_outside_tmp(sandbox, tmp_path):
    target = tmp_path / "pwned.txt"
    code = (
        "import os\n"
        f"for p in [{str(target)!r}, '/usr/pwned', '/etc/pwned', '/pwned', '/opt/pwned']:\n"
        "    try:\n"
        "        open(p, 'w').write('x')\n"
        "        print('WROTE', p)\n"
        "    except OSError as e:\n"
        "        print('denied', type(e).__name__)\n"
        "open('inside.txt', 'w').write('ok')\n"
        "print(os.getcwd(), open('inside.txt').read())")
    r = sandbox.run(code)
    assert r.status == "ok" and "WROTE" not in r.stdout, r
    assert r.stdout.count("denied") == 5 and r.stdout.rstrip().endswith("ok")
    assert not target.exists() and not os.path.exists("/usr/pwned")
    # the private temp dir is fresh per call: the file from the last call is gone
    r2 = sandbox.run("import os\nprint(os.path.exists('inside.txt'), os.listdir('/tmp'))")
    assert r2.stdout.startswith("False"), r2
    assert_pool_alive(sandbox)


def test_parent_environment_not_visible(sandbox):
    code = (
        "import os, glob\n"
        "print(sorted(os.environ))\n"
        "for p in glob.glob('/proc/*/environ'):\n"
        "    try:\n"
        "        print(open(p, 'rb').read())\n"
        "    except OSError as e:\n"
        "        print(p, type(e).__name__)")
    r = sandbox.run(code)
    assert r.status == "ok", r
    assert SECRET not in r.stdout and "COPC_TEST_SECRET" not in r.stdout
    assert "PermissionError" in r.stdout  # the fork server's environ is not readable
    assert_pool_alive(sandbox)


def test_network_blocked():
    hits = []
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(5)
    srv.settimeout(0.2)
    port = srv.getsockname()[1]
    stop = threading.Event()

    def accept() -> None:
        while not stop.is_set():
            try:
                conn, _ = srv.accept()
                hits.append(1)
                conn.close()
            except OSError:
                continue

    t = threading.Thread(target=accept, daemon=True)
    t.start()
    try:
        # sanity: the server is reachable from the host
        socket.create_connection(("127.0.0.1", port), timeout=2).close()
        time.sleep(0.3)
        assert hits == [1]
        with Sandbox(SandboxConfig(workers=1)) as sb:
            r = sb.run(f"import socket\nsocket.create_connection(('127.0.0.1', {port}), "
                       "timeout=2)\nprint('CONNECTED')")
            assert r.status == "error" and "CONNECTED" not in r.stdout, r
            assert "ConnectionRefusedError" in r.reason or "OSError" in r.reason, r
            assert_pool_alive(sb)
        time.sleep(0.3)
        assert hits == [1]
    finally:
        stop.set()
        t.join()
        srv.close()


def test_kill_parent(sandbox):
    r = sandbox.run("import os, signal\nos.kill(os.getppid(), signal.SIGKILL)")
    assert r.status == "error" and "PermissionError" in r.reason, r
    r = sandbox.run("import os, signal\nos.kill(1, signal.SIGKILL)")
    assert r.status == "error" and "PermissionError" in r.reason, r
    r = sandbox.run("import os\n"
                    "print(os.getppid(), *sorted(int(p) for p in os.listdir('/proc') if p.isdigit()))")
    ppid, *visible = (int(x) for x in r.stdout.split())
    # own PID namespace: the parent is the sandbox's fork server (an early pid of the namespace);
    # the call's /proc shows its own processes only (hidepid), never the sandbox's or the host's
    assert ppid <= 3 and visible == [101] and os.getpid() not in visible, r
    assert_pool_alive(sandbox)


def test_sys_exit_3(sandbox):
    r = sandbox.run("import sys\nprint('bye')\nsys.exit(3)")
    assert (r.exit_code, r.status, r.reason, r.stdout) == (3, "error", "exited with status 3",
                                                           "bye\n")
    assert_pool_alive(sandbox)


def test_read_stdin(sandbox):
    r = sandbox.run("import sys\nprint(repr(sys.stdin.read()))\ninput()")
    assert r.stdout == "''\n" and r.status == "error" and "EOFError" in r.reason, r
    assert_pool_alive(sandbox)


def test_syntax_error(sandbox):
    r = sandbox.run("def f(:\n  pass")
    assert r.status == "error" and "SyntaxError" in r.reason and r.exit_code == 1, r
    assert 'File "<code>", line 1' in r.stderr
    assert_pool_alive(sandbox)


def test_dead_worker_is_replaced():
    with Sandbox(SandboxConfig(workers=1)) as sb:
        (pid,) = sb.worker_pids()
        os.killpg(pid, 9)
        time.sleep(0.1)
        r = sb.run("print(1+1)")
        # issue 21: the failure of the machinery is not reported; the call reran on a new worker
        assert (r.status, r.stdout, r.exit_code) == ("ok", "2\n", 0), r
        assert sb.worker_pids() != [pid]
        assert_pool_alive(sb)


def test_concurrent_calls_from_threads(sandbox):
    results = [None] * 8

    def call(i: int) -> None:
        results[i] = sandbox.run(f"print({i} * {i})")

    threads = [threading.Thread(target=call, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [r.stdout for r in results] == [f"{i * i}\n" for i in range(8)]


def test_self_check_reports_enforcement(sandbox):
    for hello in sandbox.enforced["workers"]:
        assert hello["net_interfaces"] == ["lo"]
        assert hello["child_cap_eff"] == "0000000000000000"
        assert hello["child_uid"] not in (None, 0)


def test_module_level_run():
    r = sandbox_run("print(6 * 7)", timeout_s=5, memory_mb=256)
    assert r.stdout == "42\n" and r.ok


def test_bad_arguments(sandbox):
    with pytest.raises(ValueError, match="timeout_s"):
        sandbox.run("1", timeout_s=0)
    with pytest.raises(ValueError, match="memory_mb"):
        sandbox.run("1", memory_mb=1)
    with pytest.raises(TypeError, match="code must be str"):
        sandbox.run(b"print(1)")
    with pytest.raises(ValueError, match=r"SandboxConfig\.isolation='vm'"):
        SandboxConfig(isolation="vm")
    with pytest.raises(ValueError, match=r"SandboxConfig\.workers=0"):
        SandboxConfig(workers=0)


def test_process_isolation_warns_and_works():
    with pytest.warns(RuntimeWarning, match="WEAKER"), Sandbox(
            SandboxConfig(isolation="process", workers=1)) as sb:
        r = sb.run("import os\nprint(1+1)\nprint(sorted(os.environ))")
        assert r.stdout.startswith("2\n") and "COPC" not in r.stdout
        r = sb.run("while True: pass", timeout_s=0.5)
        assert r.status == "timeout"


def test_docker_backend_fails_clearly_without_daemon(monkeypatch):
    monkeypatch.setenv("DOCKER_HOST", "unix:///nonexistent/docker.sock")
    with pytest.raises(SandboxUnavailableError, match="docker"):
        Sandbox(SandboxConfig(isolation="docker"))


def test_missing_bwrap_fails_clearly(monkeypatch):
    monkeypatch.setattr("shutil.which", lambda name: None)
    with pytest.raises(SandboxUnavailableError, match="bubblewrap"):
        Sandbox(SandboxConfig(workers=1))


def test_the_self_check_probe_line_stays_small_with_a_crowded_tmp():
    """With isolation="process" the call's /tmp is the host's; with 3,000 entries there the probe's
    JSON line exceeded max_output_bytes and the self-check refused the sandbox (seen with 2,016
    leftover sockets in /tmp). Its /tmp listing is capped: the line stays far below the limit."""
    import json
    import subprocess
    import sys

    from environments.sandbox.selfcheck import PROBE

    code = ("import os\nreal = os.listdir\n"
            "os.listdir = lambda p: [f'entry-{i:05d}' for i in range(3000)] if p == '/tmp' else real(p)\n"
            + PROBE)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60).stdout
    assert len(out.encode()) < SandboxConfig().max_output_bytes // 4, len(out)
    assert json.loads(out)["tmp_entries"] == [f"entry-{i:05d}" for i in range(16)]
