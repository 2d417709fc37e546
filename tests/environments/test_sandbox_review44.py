"""Issue 44 item 6 (fresh review), against the real bubblewrap sandbox: system calls of the same
family as ``io_uring`` / ``userfaultfd`` that a call could still make. ``perf_event_open`` of a
user-only software counter on itself is allowed by the host's ``perf_event_paranoid = 2``, and
``modify_ldt`` (x86) writes an LDT entry: both large kernel attack surfaces no program here needs
(both succeeded before). ``bpf`` is refused by the filter too, not only by the host's sysctl."""

from __future__ import annotations

import json
import platform

import pytest

from environments.sandbox import Sandbox, SandboxConfig

from .syscall_probe import HELPER

NUMBERS = {"x86_64": {"perf_event_open": 298, "bpf": 321, "modify_ldt": 154},
           "aarch64": {"perf_event_open": 241, "bpf": 280}}

PROBE = HELPER + """
# struct perf_event_attr: PERF_TYPE_SOFTWARE, size 112, PERF_COUNT_SW_CPU_CLOCK,
# exclude_kernel | exclude_hv (what perf_event_paranoid = 2 lets any user open on itself)
attr = (ctypes.c_uint32 * 32)()
attr[0], attr[1], attr[2], attr[10] = 1, 112, 0, (1 << 5) | (1 << 6)
out = {"perf_event_open": call("perf_event_open", ctypes.byref(attr), 0, -1, -1, 0)}
bpf_attr = ctypes.create_string_buffer(128)
out["bpf"] = call("bpf", 0, bpf_attr, 72)  # BPF_MAP_CREATE of an all-zero (invalid) attr
if "modify_ldt" in nr:
    entry = ctypes.create_string_buffer(16)  # struct user_desc of entry 0, empty
    out["modify_ldt"] = call("modify_ldt", 1, entry, 16)
print(json.dumps(out))
"""

EPERM = 1


@pytest.mark.skipif(platform.machine() not in NUMBERS, reason="syscall numbers for x86_64/aarch64")
def test_perf_event_open_bpf_and_modify_ldt_are_refused_by_the_filter():
    """Each gets -1 / EPERM from the filter (before: perf_event_open returned an fd, modify_ldt 0)."""
    numbers = NUMBERS[platform.machine()]
    with Sandbox(SandboxConfig(workers=1)) as sb:
        res = sb.run(PROBE.replace("NUMBERS", repr(numbers)))
        after = sb.run("print(sum(range(10)))")  # the worker still serves calls
    assert res.ok, res
    out = json.loads(res.stdout)
    assert out == {name: [-1, EPERM] for name in numbers}, out
    assert after.ok and after.stdout.strip() == "45", after
