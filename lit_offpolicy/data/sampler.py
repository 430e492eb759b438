"""A shuffling sampler, sharded across data-parallel ranks, that a resumed run can fast-forward to
where the interrupted epoch stopped."""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch.utils.data import DistributedSampler

from lit_offpolicy.core.checks import check_range


class ResumableShuffleSampler(DistributedSampler):
    """Rank ``rank``'s share of a permutation of ``range(size)`` per epoch, drawn from ``(seed, epoch)``.

    Every rank draws the same permutation, cuts it to a multiple of ``num_replicas`` and takes every
    ``num_replicas``-th index from position ``rank``: ranks see disjoint prompts, the same number of
    them (``size // num_replicas``), deterministically. Because the order depends only on the seed
    and the epoch (Lightning calls ``set_epoch``), a run resumed mid-epoch sees the same order as the
    uninterrupted run; ``skip_once(count)`` drops the first ``count`` indices of this rank's next
    pass, the samples it already consumed. ``len`` stays the full share, so Lightning's epoch length
    and progress counters are unchanged.

    It is a ``DistributedSampler``, so Lightning uses it as given under DDP/FSDP/DeepSpeed instead of
    wrapping it in its own ``DistributedSamplerWrapper`` (whatever ``use_distributed_sampler`` says).
    """

    def __init__(self, size: int, seed: int = 0, num_replicas: int = 1, rank: int = 0) -> None:
        check_range("num_replicas", num_replicas, low=1)
        check_range("rank", rank, low=0, high=num_replicas - 1)
        if size < num_replicas:
            raise ValueError(f"size={size} prompts cannot be shared by num_replicas={num_replicas} ranks")
        super().__init__(
            range(size), num_replicas=num_replicas, rank=rank, shuffle=True, seed=seed, drop_last=True
        )
        self.size = size
        self._skip = 0

    def skip_once(self, count: int) -> None:
        self._skip = count

    def __len__(self) -> int:
        return self.size // self.num_replicas

    def __iter__(self) -> Iterator[int]:
        generator = torch.Generator().manual_seed(hash((self.seed, self.epoch)) % 2**63)
        order = torch.randperm(self.size, generator=generator).tolist()
        mine = order[: len(self) * self.num_replicas][self.rank :: self.num_replicas]
        start, self._skip = self._skip, 0
        return iter(mine[start:])
