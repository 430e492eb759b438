"""``release_freed_heap``: freed heap memory goes back to the kernel (glibc's ``malloc_trim``);
``map_large_blocks``: large blocks never enter the heap (glibc's ``M_MMAP_THRESHOLD``)."""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys
from pathlib import Path

import pytest

from lit_offpolicy.core.memory import release_freed_heap

MIB = 2**20


def _resident() -> int:
    return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.slow  # the allocator, not floats: test-numerics leaves it out
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


# Run in a fresh interpreter (the threshold is process-wide and glibc's default adapts to what the
# process freed before): a 16 MiB block is written and freed, then another is written and freed while
# a small block allocated after it pins the heap's top. Prints whether ``map_large_blocks`` applied,
# how many more blocks were mapped while the second was held, and the heap's free bytes at the end
# (mallinfo2).
_REUSE = """
import ctypes, sys
from lit_offpolicy.core.memory import map_large_blocks
class Info(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost".split()]
libc = ctypes.CDLL(None)
libc.malloc.restype, libc.free.argtypes, libc.mallinfo2.restype = ctypes.c_void_p, [ctypes.c_void_p], Info
print(map_large_blocks() if sys.argv[1] == "mapped" else None)
size = 16 * 2**20
first = libc.malloc(size); ctypes.memset(first, 1, size); libc.free(first)
mapped_before = libc.mallinfo2().hblks
second = libc.malloc(size); ctypes.memset(second, 1, size); pin = libc.malloc(4096)
print(libc.mallinfo2().hblks - mapped_before)
libc.free(second)
print(libc.mallinfo2().fordblks)
"""


def _heap_free_after_reuse(mode: str, **env: str) -> tuple[str, int, int]:
    if not hasattr(ctypes.CDLL(None), "mallinfo2"):
        pytest.skip("this C library has no mallinfo2 (glibc >= 2.33)")
    run = subprocess.run(
        [sys.executable, "-c", _REUSE, mode], env={**os.environ, **env}, capture_output=True, text=True
    )
    assert run.returncode == 0, run.stderr
    applied, mapped, free = run.stdout.split()
    return applied, int(mapped), int(free)


@pytest.mark.slow  # the allocator, not floats: test-numerics leaves it out
def test_large_blocks_freed_are_unmapped_instead_of_kept_in_the_heap():
    """glibc's default raises its mmap threshold to a freed mapped block's size, so the second 16 MiB
    block comes from the heap and its 16 MiB stay there once freed; with ``map_large_blocks`` (4 MiB)
    both are mapped and unmapped, and the heap keeps less than 1 MiB free."""
    _, default_mapped, default_free = _heap_free_after_reuse("default")
    applied, mapped, mapped_free = _heap_free_after_reuse("mapped")
    assert (default_mapped, mapped) == (0, 1)
    assert default_free >= 16 * MIB, f"{default_free / MIB:.1f} MiB"
    assert applied == "True"
    assert mapped_free < MIB, f"{mapped_free / MIB:.1f} MiB"


@pytest.mark.slow  # the allocator, not floats: test-numerics leaves it out
def test_a_threshold_the_user_set_is_left_as_it_is():
    """``MALLOC_MMAP_THRESHOLD_`` (here 64 MiB) is the user's choice: ``map_large_blocks`` changes
    nothing, and the 16 MiB block comes from the heap as the user asked (none is mapped)."""
    applied, mapped, _ = _heap_free_after_reuse("mapped", MALLOC_MMAP_THRESHOLD_=str(64 * MIB))
    assert applied == "False"
    assert mapped == 0
