"""A process's own peak resident set, for the memory benchmarks' child processes.

``resource.getrusage(RUSAGE_SELF).ru_maxrss`` is the wrong number in a child started by
``subprocess``: Linux keeps the largest resident set the process ever had, and on ``exec`` it
carries over the peak of the address space being replaced, which for a ``fork``/``vfork`` child is
the parent's. A child of a pytest process that once held 8.8 GiB reports 8.8 GiB whatever it does
itself (seen in CI, 2026-12-07). ``VmHWM`` in ``/proc/self/status`` is the peak of the current
address space only, so it starts afresh at ``exec``.
"""

from __future__ import annotations


def peak_rss_bytes() -> int:
    """This process's peak resident set since its last ``exec``, in bytes (``VmHWM``, Linux).

    Raises:
        RuntimeError: ``/proc/self/status`` has no ``VmHWM`` line (not Linux).
    """
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024  # the kernel prints kB
    raise RuntimeError("/proc/self/status has no VmHWM line: the memory benchmarks need Linux")
