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

Under data parallelism the logged figure is the largest over the ranks (``distributed.reduce_metrics``).
"""

from __future__ import annotations

from pathlib import Path

import torch

GIB = 2**30
STATUS, CLEAR_REFS = Path("/proc/self/status"), Path("/proc/self/clear_refs")
PEAK_METRICS = ("perf/max_memory_allocated", "perf/peak_rss")
"""Reduced with max over the ranks."""


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
    """Make VmHWM the current RSS (``5`` to /proc/self/clear_refs); False where that is not possible."""
    try:
        CLEAR_REFS.write_text("5")
    except OSError:
        return False
    return True


def step_peak_memory(device: torch.device) -> dict[str, float]:
    """The peak figures since the last call (GiB), and their peaks reset for the next step."""
    metrics: dict[str, float] = {}
    if device.type == "cuda":
        metrics["perf/max_memory_allocated"] = torch.cuda.max_memory_allocated(device) / GIB
        torch.cuda.reset_peak_memory_stats(device)
    peak = peak_rss_bytes()
    if peak is not None:
        metrics["perf/peak_rss"] = peak / GIB
        metrics["perf/peak_rss_resets"] = float(reset_peak_rss())
    return metrics
