"""A shuffling sampler that a resumed run can fast-forward to where the interrupted epoch stopped."""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch.utils.data import Sampler


class ResumableShuffleSampler(Sampler[int]):
    """A permutation of ``range(size)`` per epoch, drawn from ``(seed, epoch)`` alone.

    Because the order depends only on the seed and the epoch (Lightning calls ``set_epoch``), a run
    resumed mid-epoch sees the same order as the uninterrupted run; ``skip_once(count)`` drops the
    first ``count`` indices of the next pass, the samples the interrupted run already consumed.
    ``len`` stays the full epoch, so Lightning's epoch length and progress counters are unchanged.
    """

    def __init__(self, size: int, seed: int = 0) -> None:
        self.size = size
        self.seed = seed
        self.epoch = 0
        self._skip = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def skip_once(self, count: int) -> None:
        self._skip = count

    def __len__(self) -> int:
        return self.size

    def __iter__(self) -> Iterator[int]:
        generator = torch.Generator().manual_seed(hash((self.seed, self.epoch)) % 2**63)
        order = torch.randperm(self.size, generator=generator).tolist()
        start, self._skip = self._skip, 0
        return iter(order[start:])
