"""Issue 21, items 1-6: no call can break or observe a later one, and limits bound the whole call.

Every test runs hostile code in the real bubblewrap sandbox, then checks what a later call, the
pool, the host (memory, processes) or a second pool sees.
"""

from __future__ import annotations

import threading
import time

import pytest

from environments.math_tool.tool import PythonTool
from environments.sandbox import Sandbox, SandboxConfig

IPC = """
import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
IPC_CREAT = 0o1000
"""


@pytest.fixture
def one_worker():
    """A one-worker pool: every call of a test runs on the same worker, one after another."""
    with Sandbox(SandboxConfig(workers=1, timeout_s=10.0, max_output_bytes=8192,
                               tmp_size_mb=256)) as sb:
        yield sb


def shmem_kib() -> int:
    """The host's ``Shmem`` (tmpfs, /dev/shm and System V shared memory) in KiB."""
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("Shmem:"):
                return int(line.split()[1])
    raise AssertionError("no Shmem line in /proc/meminfo")


def settle(before_kib: int, tolerance_kib: int = 16 * 1024, wait_s: float = 5.0) -> int:
    """Host Shmem once it is back within ``tolerance_kib`` of ``before_kib`` (or after wait_s)."""
    end = time.monotonic() + wait_s
    now = shmem_kib()
    while abs(now - before_kib) > tolerance_kib and time.monotonic() < end:
        time.sleep(0.05)
        now = shmem_kib()
    return now


def assert_fresh(sb: Sandbox) -> None:
    """A later call sees an empty /tmp and /dev/shm and no System V IPC objects."""
    code = ("import os\n"
            "print(sorted(os.listdir('/tmp')), sorted(os.listdir('/dev/shm')))\n"
            "for kind in ('shm', 'sem', 'msg'):\n"
            "    print(kind, len(open('/proc/sysvipc/' + kind).read().splitlines()) - 1)")
    t0 = time.monotonic()
    r = sb.run(code)
    assert time.monotonic() - t0 < 3.0, "the wipe made the next call wait"
    assert (r.status, r.stdout) == ("ok", "[] []\nshm 0\nsem 0\nmsg 0\n"), r


# -- item 1: no call can break a later call -------------------------------------------------------

@pytest.mark.parametrize("plant", ["os.mkdir(d, 0)",
                                   "os.mkdir(d)\nopen(d + '/f', 'w').close()\nos.chmod(d, 0)"])
def test_preempted_work_dirs_do_not_break_later_calls(one_worker, plant):
    body = "\n".join("    " + ln for ln in plant.splitlines())
    code = (f"import os\np = os.getpid()\nfor n in range(max(1, p - 50), p + 3000):\n"
            f"    d = f'/tmp/run-{{n}}'\n    if os.path.exists(d):\n        continue\n{body}\n"
            "print('planted')")
    r = one_worker.run(code)
    assert (r.status, r.stdout) == ("ok", "planted\n"), r
    results = [one_worker.run(f"print({i} * {i})") for i in range(20)]
    assert [(x.status, x.stdout) for x in results] == [("ok", f"{i * i}\n") for i in range(20)]
    assert_fresh(one_worker)


def test_machinery_failure_is_retried_on_a_fresh_worker(one_worker):
    """The fork server shot while a call waits: the call reruns on a fresh worker, correctly."""
    import os
    import signal

    (old,) = one_worker.worker_pids()
    killer = threading.Timer(0.5, lambda: os.killpg(old, signal.SIGKILL))
    killer.start()
    try:
        r = one_worker.run("import time\ntime.sleep(1.5)\nprint('done')", timeout_s=5)
    finally:
        killer.cancel()
    assert (r.status, r.stdout) == ("ok", "done\n"), r
    assert one_worker.worker_pids() != [old]


# -- item 2: no state survives a call ------------------------------------------------------------

PLANTS = {
    "chmod_555_000": ("import os\nos.makedirs('/tmp/keep/sub/deeper')\n"
                      "open('/tmp/keep/sub/deeper/f', 'w').write('x')\n"
                      "os.chmod('/tmp/keep/sub', 0)\nos.chmod('/tmp/keep', 0o555)\n"
                      "os.makedirs('/dev/shm/keep/sub')\nos.chmod('/dev/shm/keep', 0)\n"),
    "deep_chain_1500": ("import os\nos.chdir('/tmp')\n"
                        "for _ in range(1500):\n    os.mkdir('d')\n    os.chdir('d')\n"
                        "open('leaf', 'w').write('x')\nos.chdir('/tmp')\n"),
    "sysv_ipc": IPC + (
        "shm = libc.shmget(0x1234, 1 << 20, IPC_CREAT | 0o666)\n"
        "sem = libc.semget(0x1235, 4, IPC_CREAT | 0o666)\n"
        "msg = libc.msgget(0x1236, IPC_CREAT | 0o666)\n"
        "assert min(shm, sem, msg) >= 0, (shm, sem, msg, ctypes.get_errno())\n"),
}


@pytest.mark.parametrize("name", sorted(PLANTS))
def test_no_state_survives_a_call(one_worker, name):
    r = one_worker.run(PLANTS[name] + "print('planted')")
    assert (r.status, r.stdout) == ("ok", "planted\n"), r
    assert_fresh(one_worker)
    assert_fresh(one_worker)


def test_keyrings_do_not_carry_state(one_worker):
    """The kernel keeps keyrings per uid: a key added by one call is not found by the next."""
    nrs = IPC + ("import platform\nlibc.syscall.restype = ctypes.c_long\n"
                 "ADD, REQUEST = {'x86_64': (248, 249), 'aarch64': (217, 218)}[platform.machine()]\n")
    add = nrs + ("k = libc.syscall(ADD, b'user', b'copc-note', b'42', 2, -4)\n"  # @u user keyring
                 "print('added' if k > 0 else 'refused', ctypes.get_errno() if k < 0 else '')")
    r = one_worker.run(add)
    assert r.status == "ok", r
    find = nrs + ("k = libc.syscall(REQUEST, b'user', b'copc-note', None, 0)\n"
                  "print('found' if k > 0 else 'absent')")
    r = one_worker.run(find)
    assert (r.status, r.stdout) == ("ok", "absent\n"), r


def test_every_call_sees_the_same_pids(one_worker):
    """The PID counter is reset per call: no call can pass a number to the next through it."""
    one_worker.run("import os\nfor _ in range(20):\n    if os.fork() == 0:\n        os._exit(0)\n"
                   "    os.wait()")
    pids = {one_worker.run("import os\nprint(os.getpid())").stdout for _ in range(3)}
    assert len(pids) == 1, pids


# -- item 3: memory_mb bounds the whole call -----------------------------------------------------

CHILDREN = """
import os, time
kids = []
for _ in range(6):
    pid = os.fork()
    if pid == 0:
        b = bytearray(100 * 1024 * 1024)
        for i in range(0, len(b), 4096):
            b[i] = 1
        time.sleep(3)
        os._exit(0)
    kids.append(pid)
codes = [os.waitstatus_to_exitcode(os.waitpid(k, 0)[1]) for k in kids]
print('all children finished', codes)
"""


def test_memory_bounds_all_processes_of_a_call(one_worker):
    before = shmem_kib()
    t0 = time.monotonic()
    r = one_worker.run(CHILDREN, memory_mb=128, timeout_s=8)
    assert r.status == "memory_limit" and "128 MiB" in r.reason, r
    assert "all children finished" not in r.stdout and time.monotonic() - t0 < 6, r
    assert abs(settle(before) - before) <= 16 * 1024
    assert_fresh(one_worker)


@pytest.mark.parametrize("fill", [
    "open('/tmp/big', 'wb').write(b'x' * (200 << 20))",
    "open('/dev/shm/big', 'wb').write(b'x' * (200 << 20))",
    IPC + "import mmap\nlibc.shmat.restype = ctypes.c_void_p\n"
    "for key in range(4):\n"
    "    i = libc.shmget(0x4000 + key, 60 << 20, IPC_CREAT | 0o600)\n"
    "    a = libc.shmat(i, None, 0)\n    ctypes.memset(a, 1, 60 << 20)\n    libc.shmdt(ctypes.c_void_p(a))\n",
])
def test_memory_bounds_tmpfs_and_shared_memory(one_worker, fill):
    before = shmem_kib()
    r = one_worker.run(fill + "\nprint('kept')", memory_mb=128, timeout_s=8)
    assert r.status == "memory_limit" and "kept" not in r.stdout, r
    assert abs(settle(before) - before) <= 16 * 1024
    assert_fresh(one_worker)


# -- item 4: no namespaces and no capabilities for the code ---------------------------------------

def test_no_user_namespaces_no_capabilities(one_worker):
    code = IPC + (
        "import subprocess\n"
        "for flag in (0x10000000, 0x20000, 0x40000000):\n"  # NEWUSER, NEWNS, NEWNET
        "    print('unshare', hex(flag), libc.unshare(flag))\n"
        "p = subprocess.run(['unshare', '--user', '--map-root-user', 'true'], capture_output=True)\n"
        "print('unshare-cli', p.returncode != 0)\n"
        "st = dict(l.split(':', 1) for l in open('/proc/self/status'))\n"
        "print(*(st[k].strip() for k in ('CapInh', 'CapPrm', 'CapEff', 'CapBnd', 'CapAmb')))\n"
        "print('nnp', st['NoNewPrivs'].strip())")
    r = one_worker.run(code)
    assert r.status == "ok", r
    assert r.stdout.splitlines() == [
        "unshare 0x10000000 -1", "unshare 0x20000 -1", "unshare 0x40000000 -1",
        "unshare-cli True", " ".join(["0000000000000000"] * 5), "nnp 1"], r
    for hello in one_worker.enforced["workers"]:
        assert hello["user_namespaces"] == "disabled", hello


# -- item 5: pools do not share a uid or a process budget -----------------------------------------

FORK_12 = ("import os, time\nn = 0\ntry:\n    for _ in range(12):\n        if os.fork() == 0:\n"
           "            time.sleep(2)\n            os._exit(0)\n        n += 1\nexcept OSError:\n"
           "    pass\nprint(n, os.getuid())\n")


def test_two_pools_do_not_count_each_others_processes():
    cfg = SandboxConfig(workers=1, max_processes=16)
    with Sandbox(cfg) as a, Sandbox(cfg) as b:
        out: dict[str, str] = {}
        threads = [threading.Thread(target=lambda k=k, sb=sb: out.update({k: sb.run(FORK_12).stdout}))
                   for k, sb in (("a", a), ("b", b))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        (na, ua), (nb, ub) = (out[k].split() for k in ("a", "b"))
        assert (na, nb) == ("12", "12"), out
        assert ua != ub, out


# -- item 6: the policy's code never produces an InfrastructureError -----------------------------

TRICKLE = ("import os, sys, time\nif os.fork() == 0:\n    while True:\n"
           "        print('tick', flush=True)\n        time.sleep(0.02)\nprint('main done')\n")


def test_lingering_output_is_that_programs_timeout(one_worker):
    t0 = time.monotonic()
    r = one_worker.run(TRICKLE, timeout_s=1.5)
    assert r.status == "timeout" and "main done" in r.stdout, r
    assert time.monotonic() - t0 < 3.5
    res = PythonTool(one_worker, timeout_s=1.5).run(TRICKLE)
    assert res.status == "timeout", res
    assert_fresh(one_worker)
