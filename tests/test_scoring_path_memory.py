"""A run's glibc malloc at a fixed mmap threshold (klbench.tasks.allocator): blocks freed between a run's phases go
back to the system, whichever block was freed first, so a process's peak follows what it holds (docs/scale.md,
"Whole-process peaks at V = 151,936")."""
from __future__ import annotations

import subprocess
import sys

import pytest

# in a fresh process: glibc's threshold at 32 MiB, where its dynamic rule ends once a block that size was freed (as
# in rb's run at V = 151,936), then fixed by fix_mmap_threshold ("fixed") or not ("high"); then 40 blocks growing from
# 2 MiB by 64 KiB, as a KV cache grown by torch.cat: each written, a small tensor kept after it (pinning the heap
# around the hole, which the next, larger block cannot reuse), then freed; the resident set's growth in MiB
CHILD = r"""
import ctypes, sys, torch
from klbench.tasks.allocator import M_MMAP_THRESHOLD, fix_mmap_threshold
assert ctypes.CDLL(None).mallopt(M_MMAP_THRESHOLD, 32 * 2**20)
if sys.argv[1] == "fixed":
    assert fix_mmap_threshold()
def rss():
    return next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmRSS:")) * 1024
base, keep = rss(), []
for i in range(40):
    big = torch.empty(2**19 + i * 2**14).fill_(1.0)  # 2 MiB + 64 KiB a step
    keep.append(torch.ones(64))
    del big
print((rss() - base) / 2**20)
"""


def _growth(mode: str) -> float:
    out = subprocess.run([sys.executable, "-c", CHILD, mode], capture_output=True, text=True, check=True)
    return float(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")
def test_freed_blocks_leave_the_resident_set_at_a_fixed_threshold():
    assert _growth("high") > 40  # a threshold risen to 32 MiB keeps the freed blocks on the heap (the test bites)
    assert _growth("fixed") < 20


def test_a_users_own_threshold_wins(monkeypatch):
    from klbench.tasks.allocator import fix_mmap_threshold
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "65536")
    assert fix_mmap_threshold() is False


def test_the_threshold_is_fixed_at_large_vocabularies_only(monkeypatch):
    """At the default run's vocabulary (1,024) glibc keeps its own threshold: a fixed 1 MiB one faulted in fresh pages
    for every activation (its wall time 1.10x); at V = 151,936 it is fixed."""
    import klbench.tasks.allocator as allocator
    calls = []
    monkeypatch.setattr(allocator, "fix_mmap_threshold", lambda: calls.append(1) or True)
    assert not allocator.fix_for_vocabulary(1024) and not allocator.fix_for_vocabulary(None) and not calls
    assert allocator.fix_for_vocabulary(151936) and calls == [1]
