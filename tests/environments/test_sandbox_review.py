"""Issue 21, a hostile reviewer's findings against the real bubblewrap sandbox (each failed before
its fix): a program that traces its own main process, socket state left in the network
namespace, and TCP socket buffers outside the memory limit."""

from __future__ import annotations

import pytest

from environments.sandbox import Sandbox, SandboxConfig

# The main process makes itself traceable; a child that closed stdio seizes it and never waits,
# so (had the seize worked) its zombie would be reported to the tracer only and the worker's
# wait for it would never return: the call came back as sandbox_error, retried, then an
# InfrastructureError (an excluded episode instead of a scored one: a reward hack).
PTRACE_OWN_MAIN = """
import ctypes, os, time
libc = ctypes.CDLL(None, use_errno=True)
libc.ptrace.argtypes = [ctypes.c_long, ctypes.c_long, ctypes.c_void_p, ctypes.c_void_p]
libc.prctl(4, 1, 0, 0, 0)  # PR_SET_DUMPABLE
main = os.getpid()
r, w = os.pipe()
if os.fork() == 0:
    os.close(r)
    for fd in (0, 1, 2):
        os.close(fd)
    rc = libc.ptrace(0x4206, main, None, None)  # PTRACE_SEIZE
    os.write(w, b"%d,%d" % (rc, ctypes.get_errno()))
    os.close(w)
    while True:
        time.sleep(3600)
os.close(w)
print("seize", os.read(r, 100).decode(), flush=True)
print("answer 42", flush=True)
os._exit(0)
"""

# Call A leaves a TIME_WAIT connection on a chosen port (a value a later call could read back);
# call B must be able to bind that port and see no TCP socket at all.
PLANT_TIME_WAIT = """
import socket
srv = socket.socket(); srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
srv.bind(("127.0.0.1", 32495)); srv.listen(1)
c = socket.socket(); c.connect(("127.0.0.1", 32495))
s, _ = srv.accept(); s.close()  # the accepting side closes first: TIME_WAIT on port 32495
c.recv(1); c.close()
print("planted")
"""
READ_TIME_WAIT = """
import socket
print(len(open("/proc/net/tcp").read().splitlines()) - 1, "tcp sockets")
t = socket.socket(); t.bind(("127.0.0.1", 32495)); print("bind ok")
"""

# Queue as much as possible in loopback TCP buffers (unread), then report how much was queued.
TCP_BUFFERS = """
import socket
srv = socket.socket(); srv.bind(("127.0.0.1", 0)); srv.listen(128)
chunk, total, held = b"z" * (1 << 20), 0, []
for i in range(40):
    c = socket.socket(); c.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4 << 20)
    c.connect(srv.getsockname()); s, _ = srv.accept()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)
    c.setblocking(False)
    while True:
        try:
            total += c.send(chunk)
        except (BlockingIOError, OSError):
            break
    held.append((c, s))
    if total > (400 << 20):
        break
print(total >> 20)
"""


@pytest.fixture
def one_worker():
    """A one-worker pool: the calls of a test run on the same worker, one after another."""
    with Sandbox(SandboxConfig(workers=1, timeout_s=5.0, max_output_bytes=8192)) as sb:
        yield sb


def test_a_program_cannot_trace_its_own_main_process(one_worker):
    r = one_worker.run(PTRACE_OWN_MAIN, timeout_s=3.0)
    assert r.status == "ok", r
    assert r.stdout == "seize -1,1\nanswer 42\n"  # ptrace refused with EPERM; the answer is scored
    assert one_worker.run("print(2)").stdout == "2\n"


def test_socket_state_does_not_survive_a_call(one_worker):
    assert one_worker.run(PLANT_TIME_WAIT).stdout == "planted\n"
    for _ in range(2):
        r = one_worker.run(READ_TIME_WAIT)
        assert (r.status, r.stdout) == ("ok", "0 tcp sockets\nbind ok\n"), r


def test_tcp_socket_buffers_are_bounded_by_memory_mb(one_worker):
    r = one_worker.run(TCP_BUFFERS, memory_mb=128, timeout_s=10.0)
    assert r.status in ("ok", "memory_limit"), r
    if r.status == "ok":  # the sends stop at the limit instead
        assert int(r.stdout) <= 128, r.stdout


def test_the_code_sees_only_its_own_processes_in_proc(one_worker):
    """The fork server's ``/proc/<pid>/stat`` (page faults, peak RSS) moved with what earlier calls
    did (a few bits between calls); the call's own ``/proc`` hides other uids' processes."""
    code = ("import os\n"
            "print(sorted(p for p in os.listdir('/proc') if p.isdigit()) == [str(os.getpid())])\n"
            "print(os.path.exists('/proc/2/stat'), os.path.exists('/proc/1/stat'))")
    for _ in range(2):
        r = one_worker.run(code)
        assert (r.status, r.stdout) == ("ok", "True\nFalse False\n"), r
