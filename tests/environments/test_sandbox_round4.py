"""Issue 44 item 2, against the real bubblewrap sandbox (each failed before its fix): system calls
the seccomp filter now refuses (``io_uring_*``, ``userfaultfd``, ``personality`` changes) and the
host identifiers a call can no longer read (boot id, kernel command line, the pool's host pid)."""

from __future__ import annotations

import json
import os
import platform

import pytest

from environments.sandbox import Sandbox, SandboxConfig

from .syscall_probe import HELPER

SYSCALLS = {"x86_64": {"io_uring_setup": 425, "io_uring_enter": 426, "io_uring_register": 427,
                       "userfaultfd": 323, "personality": 135},
            "aarch64": {"io_uring_setup": 425, "io_uring_enter": 426, "io_uring_register": 427,
                        "userfaultfd": 282, "personality": 92}}

# Each call as a working program would make it: a valid io_uring_setup, enter/register on the fd
# it returned (or -1), a user-mode-only userfaultfd (allowed unprivileged even with
# vm.unprivileged_userfaultfd = 0), a personality change (ADDR_NO_RANDOMIZE) and the query.
PROBE = HELPER + """
params = ctypes.create_string_buffer(120)
out = {"io_uring_setup": call("io_uring_setup", 4, params)}
ring = out["io_uring_setup"][0]
out["io_uring_enter"] = call("io_uring_enter", ring, 0, 0, 0, None, 0)
out["io_uring_register"] = call("io_uring_register", ring, 9, None, 0)  # IORING_REGISTER_PROBE
out["userfaultfd"] = call("userfaultfd", os.O_CLOEXEC | 1)  # UFFD_USER_MODE_ONLY
out["personality_set"] = call("personality", ctypes.c_ulong(0x0040000))  # ADDR_NO_RANDOMIZE
out["personality_query"] = call("personality", ctypes.c_ulong(0xFFFFFFFF))
print(json.dumps(out))
"""

EPERM = 1


@pytest.fixture(scope="module")
def pool():
    """A 1-worker bwrap pool of this test process."""
    with Sandbox(SandboxConfig(workers=1)) as sb:
        yield sb


@pytest.mark.skipif(platform.machine() not in SYSCALLS, reason="syscall numbers for x86_64/aarch64")
def test_io_uring_userfaultfd_and_personality_changes_are_refused(pool):
    """Every io_uring call, userfaultfd and a personality change get EPERM; the personality
    query still answers (0, PER_LINUX)."""
    res = pool.run(PROBE.replace("NUMBERS", repr(SYSCALLS[platform.machine()])))
    assert res.ok, res
    out = json.loads(res.stdout)
    for name in ("io_uring_setup", "io_uring_enter", "io_uring_register", "userfaultfd",
                 "personality_set"):
        assert out[name] == [-1, EPERM], (name, out)
    assert out["personality_query"] == [0, 0], out


def test_host_identifiers_are_not_readable(pool):
    """The host's boot id and kernel command line read as empty in a call, and nothing the
    call reads about its cgroups names the pool's host pid (the cgroup directories did:
    ``copc-sandbox-<pid>-<n>/slot-<i>``)."""
    code = ("import json\nout = {}\n"
            "for p in ('/proc/sys/kernel/random/boot_id', '/proc/cmdline', '/proc/self/cgroup',\n"
            "          '/proc/self/mountinfo'):\n"
            "    out[p] = open(p).read()\n"
            "print(json.dumps(out))")
    res = pool.run(code)
    assert res.ok, res
    seen = json.loads(res.stdout)
    with open("/proc/sys/kernel/random/boot_id") as f:
        boot_id = f.read().strip()
    with open("/proc/cmdline") as f:
        cmdline = f.read().strip()
    assert boot_id and cmdline  # the host's are there to hide
    assert seen["/proc/sys/kernel/random/boot_id"] == "" and seen["/proc/cmdline"] == "", seen
    for path in ("/proc/self/cgroup", "/proc/self/mountinfo"):
        assert "copc-sandbox-" not in seen[path] and f"-{os.getpid()}-" not in seen[path], seen[path]
    assert all(line.endswith(":/") for line in seen["/proc/self/cgroup"].splitlines()), seen
