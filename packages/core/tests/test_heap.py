"""`ember_core.heap.release_free_memory`: the heap's free pages go back to the system, and with a
growth bound only once the process has grown by it."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from ember_core.heap import release_free_memory

STATM = Path("/proc/self/statm")


def resident_mib() -> float:
    pages = int(STATM.read_text().split()[1])
    return pages * os.sysconf("SC_PAGE_SIZE") / 2**20


def fragment_the_heap() -> list[bytearray]:
    """2000 heap blocks of 64 KiB (below glibc's mmap threshold), every tenth kept: the kept
    ones pin the heap, so the 112 MiB freed between them stay resident until released."""
    blocks = [bytearray(64 * 1024) for _ in range(2000)]
    return blocks[::10]


@pytest.mark.skipif(not STATM.exists(), reason="reads the resident size from /proc")
def test_fragments_left_by_freed_blocks_go_back_to_the_system():
    if not release_free_memory():
        pytest.skip("the C library has no malloc_trim")
    kept = fragment_the_heap()
    before = resident_mib()
    # Grown by about 112 MiB since the release above: a bound of 1 TiB releases nothing.
    assert not release_free_memory(min_growth_mib=2**20)
    assert resident_mib() > before - 5
    assert release_free_memory(min_growth_mib=50)  # grown past 50 MiB: released
    after = resident_mib()
    assert before - after > 50, (before, after)
    assert all(len(b) == 64 * 1024 and not any(b[:16]) for b in kept)  # the kept ones intact
    # Nothing grew since: the bound holds the next release back, the plain call does not.
    assert not release_free_memory(min_growth_mib=50)
    assert release_free_memory()
