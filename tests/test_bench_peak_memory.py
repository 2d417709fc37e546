"""The memory benchmarks' peak: a child's own, never its parent's (the CI failure of 2026-12-07)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GIB = 1 << 30


def test_a_child_of_a_big_parent_reports_its_own_peak_not_the_parents():
    """A parent touches 1 GiB and frees it, then starts a child: the child's ``ru_maxrss`` is the
    parent's 1 GiB (Linux carries it over ``exec``), ``peak_rss_bytes`` is the child's own (< 0.2 GiB);
    the child then touches 0.5 GiB itself and ``peak_rss_bytes`` rises by that much (±10 %)."""
    child = textwrap.dedent(f"""
        import json, resource, sys
        sys.path.insert(0, {str(ROOT / 'benchmarks')!r})
        from peak_memory import peak_rss_bytes
        first = peak_rss_bytes()
        maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        b = bytearray({GIB // 2}); b[::4096] = b"\\1" * len(b[::4096])
        print(json.dumps([first, maxrss, peak_rss_bytes()]))
    """)
    parent = textwrap.dedent(f"""
        import subprocess, sys
        b = bytearray({GIB}); b[::4096] = b"\\1" * len(b[::4096]); del b
        print(subprocess.run([sys.executable, "-c", {child!r}], capture_output=True, text=True,
                             check=True).stdout)
    """)
    out = subprocess.run([sys.executable, "-c", parent], capture_output=True, text=True, check=True,
                         timeout=120)
    first, maxrss, after = json.loads(out.stdout.strip())
    assert maxrss >= 0.95 * GIB  # the pitfall: the parent's peak
    assert first < 0.2 * GIB
    assert abs((after - first) - GIB // 2) <= 0.1 * GIB // 2
