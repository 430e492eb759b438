"""``release_freed_heap``: freed heap memory goes back to the kernel (glibc's ``malloc_trim``)."""

from __future__ import annotations

import ctypes
import os
from pathlib import Path

import pytest

from lit_offpolicy.core.memory import release_freed_heap

MIB = 2**20


def _resident() -> int:
    return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_the_freed_middle_of_the_heap_goes_back_to_the_kernel():
    """64 MiB of 4 KiB blocks (below malloc's mmap threshold: on the heap), written, then all freed but
    the last, which pins the heap's top so that ``free`` alone cannot shrink it: the trim returns the
    pages of the freed middle (``MADV_DONTNEED``), so the resident set falls by most of the 64 MiB."""
    libc = ctypes.CDLL(None)
    if not hasattr(libc, "malloc_trim"):
        pytest.skip("this C library has no malloc_trim (not glibc)")
    libc.malloc.restype = ctypes.c_void_p
    libc.free.argtypes = [ctypes.c_void_p]
    blocks = [libc.malloc(4096) for _ in range(64 * MIB // 4096)]
    for block in blocks:
        ctypes.memset(block, 1, 4096)
    for block in blocks[:-1]:
        libc.free(block)
    before = _resident()
    assert release_freed_heap()
    released = before - _resident()
    libc.free(blocks[-1])
    assert released > 32 * MIB, f"{released / MIB:.1f} MiB released"
