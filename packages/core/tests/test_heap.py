"""`ember_core.heap.release_free_memory`: the heap's free pages go back to the system."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from ember_core.heap import release_free_memory

STATM = Path("/proc/self/statm")


def resident_mib() -> float:
    pages = int(STATM.read_text().split()[1])
    return pages * os.sysconf("SC_PAGE_SIZE") / 2**20


@pytest.mark.skipif(not STATM.exists(), reason="reads the resident size from /proc")
def test_fragments_left_by_freed_blocks_go_back_to_the_system():
    if not release_free_memory():
        pytest.skip("the C library has no malloc_trim")
    # 2000 heap blocks of 64 KiB (below glibc's mmap threshold), every tenth kept: the kept
    # ones pin the heap, so the free blocks between them stay resident until trimmed.
    blocks = [bytearray(64 * 1024) for _ in range(2000)]
    kept = blocks[::10]
    del blocks
    before = resident_mib()
    assert release_free_memory()
    after = resident_mib()
    assert before - after > 50, (before, after)  # of the 112 MiB freed
    assert all(len(b) == 64 * 1024 and not any(b[:16]) for b in kept)  # the kept ones intact
