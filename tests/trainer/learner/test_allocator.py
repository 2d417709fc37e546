"""``learner.malloc_mmap_threshold`` (:mod:`trainer.learner.allocator`): with glibc's dynamic
threshold, freed activation-sized tensors stay resident; with the fixed threshold they leave the
resident set. Measured in fresh processes (the setting is per process) with real torch tensors."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from trainer.config import ConfigError, load_config
from trainer.learner.allocator import (
    DEFAULT_MMAP_THRESHOLD,
    LOW_MEMORY_MMAP_THRESHOLD,
    set_malloc_mmap_threshold,
)

from ..app.test_run_e2e import REPO

#: In a fresh process: set the threshold (argv[1] bytes, 0: glibc default), free one 16 MiB tensor
#: (raises glibc's dynamic threshold to 16 MiB), allocate 150 tensors of 2 MiB interleaved with 64 KiB
#: small ones that stay alive (so the heap cannot shrink from the top), free the large ones;
#: with argv[2] == "trim", then hand the free heap back (``release_free_heap``); print how much
#: resident memory the free (and the trim) gave back, in MiB.
CHILD = r"""
import json, os, sys
import torch
from trainer.learner.allocator import release_free_heap, set_malloc_mmap_threshold
def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
applied = set_malloc_mmap_threshold(int(sys.argv[1]))
big = torch.ones(4 * 2**20)
del big
large, small = [], []
for _ in range(150):
    large.append(torch.ones(2**19))
    small.append(torch.ones(2**14))  # 64 KiB: from the top of the heap, between the large ones
before = rss()
del large
trimmed = release_free_heap() if sys.argv[2] == "trim" else None
print(json.dumps({"applied": applied, "trimmed": trimmed, "released_mib": before - rss()}))
"""


def _released(threshold: int, trim: bool = False) -> dict:
    res = subprocess.run([sys.executable, "-c", CHILD, str(threshold), "trim" if trim else "keep"],
                         cwd=REPO, capture_output=True, text=True, timeout=120,
                         env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"})
    assert res.returncode == 0, res.stderr[-2000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


def test_fixed_threshold_gives_freed_tensors_back_and_glibc_default_keeps_them():
    default, fixed = _released(DEFAULT_MMAP_THRESHOLD), _released(LOW_MEMORY_MMAP_THRESHOLD)
    assert default["applied"] is False and fixed["applied"] is True
    assert default["released_mib"] < 30, default  # 300 MiB freed, kept resident in the heap
    assert fixed["released_mib"] > 280, fixed  # 150 × 2 MiB unmapped


def test_malloc_trim_gives_the_heap_kept_freed_tensors_back():
    trimmed = _released(DEFAULT_MMAP_THRESHOLD, trim=True)
    assert trimmed["applied"] is False and trimmed["trimmed"] is True
    assert trimmed["released_mib"] > 280, trimmed  # the 300 MiB the default threshold kept resident


@pytest.mark.parametrize("value", [-1, 2**25 + 1, 1.5, True])
def test_bad_threshold_is_refused_naming_the_key(value):
    with pytest.raises(ValueError, match=r"^learner\.malloc_mmap_threshold="):
        set_malloc_mmap_threshold(value)
    with pytest.raises(ConfigError) as e:
        load_config(None, [f"learner.malloc_mmap_threshold={value}"])
    assert str(e.value).startswith("learner.malloc_mmap_threshold") and "\n" not in str(e.value)


def test_default_leaves_glibc_alone_and_the_low_memory_value_is_1_mib():
    assert load_config(None, []).learner.malloc_mmap_threshold == 0  # glibc's dynamic threshold: fastest
    assert set_malloc_mmap_threshold(0) is False
    assert LOW_MEMORY_MMAP_THRESHOLD == 2**20
