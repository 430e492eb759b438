"""Torch's CPU threads for the model's size: one thread for a small model, unless ``OMP_NUM_THREADS`` says.

A small model's operations take microseconds, so its threads meet at a barrier every few microseconds;
with another process busy on the machine, one of them is often off its core for a scheduler tick
while the others spin. The tiny Llama's SFT warm-up (1.08M parameters, 2 cores, one other busy
process) ran at 0.36 steps/s with torch's default 2 threads and at 12 with one; alone with 2 threads
it ran about 13 (550 steps in 41 s, docs/demo.md), so one thread costs little there. Larger models
keep torch's default: their operations are long enough for threads to pay.
"""

from __future__ import annotations

import os

import torch

ONE_THREAD_BELOW = 10_000_000
"""Models with fewer parameters than this run on one torch thread: the built-in tiny models (0.5M-1.1M),
not a real language model. Not tuned: where threads start to pay alone was not measured (no quiet machine);
beside a busy process, 2 threads were 3x slower than one for 0.3M-34M-parameter Llamas."""


def threads_for(parameters: int, default: int) -> int:
    """Intra-op threads for a model of ``parameters``: 1 below ``ONE_THREAD_BELOW``, else ``default``."""
    return 1 if parameters < ONE_THREAD_BELOW else default


def choose_threads(model: torch.nn.Module) -> str | None:
    """Set torch's threads for ``model``'s size (``threads_for``), unless ``OMP_NUM_THREADS`` is set:
    that is the user's choice. A line saying what changed, or None where nothing did."""
    if os.environ.get("OMP_NUM_THREADS"):
        return None
    parameters = sum(p.numel() for p in model.parameters())
    current = torch.get_num_threads()
    threads = threads_for(parameters, current)
    if threads == current:
        return None
    torch.set_num_threads(threads)
    return (
        f"torch runs on {threads} CPU thread(s), not {current}: a {parameters / 1e6:.2f}M-parameter model's "
        f"operations are too short for threads to pay (OMP_NUM_THREADS=N chooses)"
    )
