"""The C allocator's mmap threshold of a learner process (glibc ``mallopt(M_MMAP_THRESHOLD)``).

PyTorch's CPU tensors come from ``malloc``. glibc serves an allocation from ``mmap`` (returned to
the OS on free) only from its *mmap threshold* up; the threshold is dynamic by default: after a
large mmap-ed block is freed it rises to that block's size (up to 32 MiB on 64-bit), so from then
on tensors of up to 32 MiB come from the heap, and freed heap memory mostly stays resident. A
learner step allocates and frees thousands of such activations, so its resident set grows ~1.5 GB
above the live tensors on SmolLM2-135M at 8 × 512 tokens (``benchmarks/bench_learner_memory.py``).
A fixed threshold (``learner.malloc_mmap_threshold``, e.g. :data:`LOW_MEMORY_MMAP_THRESHOLD`)
keeps resident memory near the live tensors, but every large allocation is then freshly mapped
and page-faulted: measured on that step with gradient checkpointing, peak RSS 6.26–6.87 →
4.73 GiB; the step time was 212 → 256 s (system time 106 → 176 s) on 2026-12-03 under load, and
102 → 103 s and 98 → 97 s on 2026-12-04, idle. So the default stays 0 (glibc's dynamic
threshold, never slower) and the fixed threshold is the option for a run that must fit.
Setting it disables the dynamic adjustment (glibc's documented behaviour, as the
``MALLOC_MMAP_THRESHOLD_`` environment variable does).

Between steps the freed heap can also be handed back with glibc's ``malloc_trim(0)``
(:func:`release_free_heap`, ``learner.malloc_trim``, on by default): it returns every arena's free
pages to the OS. Without it the search main job's process (SmolLM2-135M, learner and rollout
engine in two threads) grew by ~3 GB per learner step, 5 → 21 GB in 4 steps, and was OOM-killed at
24.6 GB; with it the resident set falls back to ~3.5 GB after every step (peak ~9.7 GB within one),
at ~0.25 s per call and no slower steps (measured 2026-12-04, 2 cores).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging

log = logging.getLogger(__name__)

#: glibc's ``M_MMAP_THRESHOLD`` parameter number (``<malloc.h>``).
M_MMAP_THRESHOLD = -3
#: ``learner.malloc_mmap_threshold``'s default: 0, glibc's dynamic threshold (the fastest).
DEFAULT_MMAP_THRESHOLD = 0
#: The fixed threshold: ~1/3 less peak RSS, at 0–20 % of step time (bench_learner_memory).
LOW_MEMORY_MMAP_THRESHOLD = 2**20
#: The largest threshold glibc accepts on 64-bit (``HEAP_MAX_SIZE / 2`` = ``DEFAULT_MMAP_THRESHOLD_MAX``).
MAX_MMAP_THRESHOLD = 32 * 2**20


def release_free_heap() -> bool:
    """Return the C heap's free memory to the OS (glibc ``malloc_trim(0)``: every arena, top and
    free pages inside), e.g. after a learner step.

    Returns:
        True when glibc's ``malloc_trim`` ran (whether or not it released anything); False where the
        C library has none (not glibc), logged once per process at info level.
    """
    trim = _malloc_trim()
    if trim is None:
        return False
    trim(0)
    return True


@functools.cache
def _malloc_trim() -> object | None:
    """The C library's ``malloc_trim`` (looked up once per process: ``find_library`` runs
    ``ldconfig``), or None where it has none (logged then, once)."""
    trim = getattr(ctypes.CDLL(ctypes.util.find_library("c")), "malloc_trim", None)
    if trim is None:
        log.info("learner.malloc_trim: this C library has no glibc malloc_trim; nothing released")
    return trim


def check_mmap_threshold(nbytes: object) -> int:
    """``nbytes`` when it is a valid ``learner.malloc_mmap_threshold`` (an int in ``[0, 32 MiB]``).

    Raises:
        ValueError: one line naming ``learner.malloc_mmap_threshold`` and the value.
    """
    if isinstance(nbytes, bool) or not isinstance(nbytes, int) or not 0 <= nbytes <= MAX_MMAP_THRESHOLD:
        raise ValueError(f"learner.malloc_mmap_threshold={nbytes!r}: must be an int in "
                         f"[0, {MAX_MMAP_THRESHOLD}] (bytes)")
    return nbytes


def set_malloc_mmap_threshold(nbytes: int) -> bool:
    """Fix this process's malloc mmap threshold at ``nbytes`` (0: leave glibc's dynamic default).

    Args:
        nbytes: allocations of at least this many bytes are ``mmap``-ed (and unmapped on free).

    Returns:
        True when the threshold was set; False for ``nbytes == 0`` or where the C library has no
        ``mallopt`` (not glibc: e.g. musl, macOS), which is logged once at info level.

    Raises:
        ValueError: ``nbytes`` outside ``[0, 32 MiB]`` (glibc's maximum on 64-bit;
            :func:`check_mmap_threshold`).
    """
    if check_mmap_threshold(nbytes) == 0:
        return False
    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    mallopt = getattr(libc, "mallopt", None)
    if mallopt is None or not mallopt(M_MMAP_THRESHOLD, nbytes):
        log.info("learner.malloc_mmap_threshold: this C library has no glibc mallopt; left as it is")
        return False
    return True
