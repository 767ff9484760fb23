"""glibc's malloc at a fixed mmap threshold for a run: a whole process's peak then follows what it holds.

    fix_mmap_threshold()   # once, at a run's start (klbench.tasks.train.run_task); nothing off glibc

By default glibc moves its mmap threshold up to the size of the largest mmapped block freed so far (up to 32 MiB),
and from then on serves blocks below it from the heap, which keeps what is freed. Which block raises it first
depends on the order of a run's allocations, so two runs of one size could hold very different heaps: at
V = 151,936 (2 x 2 x 512, a Qwen2-shaped folder) `rb`'s heap stood at 3.2 GiB during the step-0 validation's
rollout (its KV cache grows by torch.cat a token at a time, a few MiB per layer), `loo`'s at 0.26 GiB, in the
same code (docs/scale.md, "Whole-process peaks at V = 151,936"). Setting the threshold turns that adjustment off
(mallopt(3)): blocks of 1 MiB and more are mmapped and go back to the system when freed. A user's own
MALLOC_MMAP_THRESHOLD_ wins.

Only at large vocabularies (LARGE_VOCAB): every mmapped block is zeroed pages faulted in afresh, and the default run's
activations (about 1.3 MiB each) paid that on every step: its wall time 1.10x, its system time 2.2x with the
threshold fixed (5.71 s against 5.17 s, 3 interleaved pairs on the idle VM), for no memory that matters there.
"""
from __future__ import annotations

import ctypes
import os
import sys

M_MMAP_THRESHOLD = -3  # glibc's malloc.h
THRESHOLD = 1 << 20  # bytes: blocks this size and above are mmapped
LARGE_VOCAB = 32768  # a run whose vocabulary reaches this has its threshold fixed (fix_for_vocabulary)


def fix_mmap_threshold(threshold: int = THRESHOLD) -> bool:
    """Whether glibc's mmap threshold was set (False off Linux or glibc, or where the environment sets it)."""
    if not sys.platform.startswith("linux") or "MALLOC_MMAP_THRESHOLD_" in os.environ:
        return False
    try:
        libc = ctypes.CDLL(None)
        mallopt, _ = libc.mallopt, libc.gnu_get_libc_version  # musl has mallopt as a stub and no version call
    except (OSError, AttributeError):
        return False
    return bool(mallopt(M_MMAP_THRESHOLD, int(threshold)))


def fix_for_vocabulary(vocab: int | None) -> bool:
    """fix_mmap_threshold() for a run whose vocabulary reaches LARGE_VOCAB (None: a model without one, tabular)."""
    return vocab is not None and vocab >= LARGE_VOCAB and fix_mmap_threshold()
