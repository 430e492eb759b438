"""Peak memory of each training step, as metrics: ``perf/max_memory_allocated`` (CUDA) and ``perf/peak_rss``.

Both are in GiB and cover the time since the previous step's figure (the first: since the process
started): the rollout that fed the step, its prepare and update, and the previous step's weight sync.
Each reading resets its peak:

- CUDA: ``torch.cuda.max_memory_allocated`` of the step's device, the tensors' memory as PyTorch's
  caching allocator counts it (not the allocator's reserved pool, nor other processes'), then
  ``torch.cuda.reset_peak_memory_stats``.
- every device: the process's peak resident set size, ``VmHWM`` of /proc/self/status, reset by
  writing ``5`` to /proc/self/clear_refs (Linux ≥ 4.0). Where that file cannot be written the figure
  is the high-water mark since the process started, as ``ru_maxrss`` would be, and
  ``perf/peak_rss_resets`` is 0 (1 where the reset works). Outside Linux there is no ``perf/peak_rss``.

The reset is the kernel's: afterwards ``VmHWM`` and ``getrusage``'s ``ru_maxrss`` of the process (what
``/usr/bin/time -v`` reports as its maximum resident set) start again from the RSS of that moment.
The process's peak since it started is the largest ``perf/peak_rss`` of the run, or, in the process,
``process_peak_rss_bytes()`` (likewise ``process_max_memory_allocated`` on CUDA).

Under data parallelism the logged figure is the largest over the ranks (``distributed.reduce_metrics``).

Between steps ``release_freed_heap`` returns the heap memory the step freed (``malloc_trim``, below);
``map_large_blocks`` (set when a module is built) keeps large tensors out of the heap in the first place.
"""

from __future__ import annotations

import ctypes
import functools
import os
from pathlib import Path

import torch

GIB = 2**30
MMAP_THRESHOLD_BYTES = 4 * 2**20
"""``map_large_blocks``' threshold: each allocation of 4 MiB or more (an activation of 2,048 tokens at
hidden 512 in float32, say) gets its own mapping."""
M_MMAP_THRESHOLD = -3  # mallopt's parameter number (glibc's malloc.h)
STATUS, CLEAR_REFS = Path("/proc/self/status"), Path("/proc/self/clear_refs")
PEAK_METRICS = ("perf/max_memory_allocated", "perf/peak_rss")
"""Reduced with max over the ranks."""
_cleared = {"rss": 0, "cuda": 0}
"""The largest peaks (bytes) that a reset here has cleared: what the process's peak must still count."""


def peak_rss_bytes() -> int | None:
    """The process's peak resident set size since it started or since the last reset (VmHWM); None
    where /proc/self/status has no VmHWM."""
    try:
        lines = STATUS.read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024  # kB
    return None


def reset_peak_rss() -> bool:
    """Make VmHWM the current RSS (``5`` to /proc/self/clear_refs), keeping the peak it held for
    ``process_peak_rss_bytes``; False where that is not possible."""
    before = peak_rss_bytes() or 0
    try:
        CLEAR_REFS.write_text("5")
    except OSError:
        return False
    _cleared["rss"] = max(_cleared["rss"], before)
    return True


def process_peak_rss_bytes() -> int | None:
    """The process's peak RSS since it started, across the resets of ``reset_peak_rss``."""
    current = peak_rss_bytes()
    return None if current is None else max(current, _cleared["rss"])


def process_max_memory_allocated(device: torch.device | str | None = None) -> int:
    """``torch.cuda.max_memory_allocated`` since the process started, across the resets of
    ``step_peak_memory``."""
    return max(torch.cuda.max_memory_allocated(device), _cleared["cuda"])


def step_peak_memory(device: torch.device) -> dict[str, float]:
    """The peak figures since the last call (GiB), and their peaks reset for the next step."""
    metrics: dict[str, float] = {}
    if device.type == "cuda":
        allocated = torch.cuda.max_memory_allocated(device)
        metrics["perf/max_memory_allocated"] = allocated / GIB
        _cleared["cuda"] = max(_cleared["cuda"], allocated)
        torch.cuda.reset_peak_memory_stats(device)
    peak = peak_rss_bytes()
    if peak is not None:
        metrics["perf/peak_rss"] = peak / GIB
        metrics["perf/peak_rss_resets"] = float(reset_peak_rss())
    return metrics


@functools.cache
def _malloc_trim():
    """glibc's ``malloc_trim``, or None where the C library has none (musl, macOS)."""
    return getattr(ctypes.CDLL(None), "malloc_trim", None)  # the symbols the interpreter has loaded


def release_freed_heap() -> bool:
    """Return the free memory of every malloc arena to the kernel, ``malloc_trim(0)``: the top of each
    heap and the free pages inside it (glibc ≥ 2.8). False where there is no ``malloc_trim``.

    glibc keeps freed blocks mapped for reuse; without the trim the resident set between steps drifted
    up by 2.5% per 1,000 steps in the sync soak (``benchmarks/learning/soak.py``, issue #37) while the Python
    objects and tensors held stayed the same.

    Each arena is locked while it is trimmed, so threads that allocate meanwhile (the async producer,
    TensorBoard's writer) wait, and nothing is lost; it took about 30 ms on the tiny model's 750 MiB
    process (2 cores)."""
    trim = _malloc_trim()
    if trim is None:
        return False
    trim(0)
    return True


@functools.cache
def map_large_blocks(threshold: int = MMAP_THRESHOLD_BYTES) -> bool:
    """Serve every allocation of ``threshold`` bytes or more by its own ``mmap``, unmapped when it is
    freed: glibc's ``mallopt(M_MMAP_THRESHOLD, threshold)``, once per process. False where the user set
    the threshold (``GLIBC_TUNABLES`` with ``glibc.malloc.mmap_threshold``, ``MALLOC_MMAP_THRESHOLD_``),
    which is left as it is, or where the C library has no ``mallopt`` (musl, macOS).

    By default glibc raises its threshold to the size of each mapped block freed, up to 32 MiB. After
    the first steps the activations and gradients below 32 MiB then come from the heap, which keeps
    their pages when they are freed and reuses them only for blocks that fit the holes: on the 181M
    Qwen3 shape (``benchmarks/peers/memory_vs_trl.py``, B = 8, 64 + 512 tokens, 2 updates, 2 cores) the heap
    held 904 MiB free at the optimizer step, and the update's peak RSS was 4,370 to 4,924 MiB over
    three runs. With the fixed threshold it held 6 to 37 MiB and the peak was 3,796 to 3,897 MiB. The
    cost is the page faults of blocks mapped afresh: the second update took 40.5..44.0 s against
    38.1..41.1 s (3 runs each; 31.4..32.9 against 27.8..31.8 s once the LM head had its own backward,
    ``training/chunked_head.py``).
    """
    user_set = "glibc.malloc.mmap_threshold" in os.environ.get("GLIBC_TUNABLES", "")
    mallopt = getattr(ctypes.CDLL(None), "mallopt", None)
    if user_set or "MALLOC_MMAP_THRESHOLD_" in os.environ or mallopt is None:
        return False
    return bool(mallopt(M_MMAP_THRESHOLD, threshold))
