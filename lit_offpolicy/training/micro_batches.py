"""Micro-batches of a mini-batch: a fixed number of samples, or a token budget.

Either way the result is a list of index groups (a partition of the samples), so that the update
and the no-grad passes cut a batch the same way, and results can be put back in sample order.
"""

from __future__ import annotations

import torch
from torch import Tensor


def by_size(num_samples: int, size: int | None) -> list[Tensor]:
    """Consecutive groups of ``size`` samples (the last may be smaller); None: one group."""
    return list(torch.arange(num_samples).split(size or max(num_samples, 1)))


def by_token_budget(lengths: Tensor, budget: int) -> list[Tensor]:
    """Groups of at most ``budget`` tokens (Σ of their samples' ``lengths``), as few as first-fit
    decreasing finds: the longest sample first, each into the first group it fits in, else a new one.
    A sample longer than the budget is an error (one line, naming the option)."""
    longest = int(lengths.max()) if len(lengths) else 0
    if longest > budget:
        raise ValueError(
            f"update.max_tokens_per_micro_batch={budget} is smaller than a sample of {longest} tokens "
            "(prompt + response); allowed values: at least the longest prompt + sampling.max_tokens"
        )
    groups: list[list[int]] = []
    room: list[int] = []
    for index in torch.argsort(lengths, descending=True, stable=True).tolist():
        length = int(lengths[index])
        fit = next((g for g, free in enumerate(room) if free >= length), None)
        if fit is None:
            groups.append([])
            room.append(budget)
            fit = len(groups) - 1
        groups[fit].append(index)
        room[fit] -= length
    return [torch.tensor(sorted(group), dtype=torch.long) for group in groups]


def equalized(groups: list[Tensor], lengths: Tensor, target: int) -> list[Tensor]:
    """``groups`` split into ``target`` groups (the most any rank has: ``distributed.max_over_ranks``).

    The group with the most tokens among those of two samples or more is halved (by tokens, keeping
    the samples' order) until the count is reached; groups only shrink, so the budget still holds.
    """
    # Under data parallelism every micro-batch's backward all-reduces the gradients (DDP) or gathers the
    # parameters (FSDP), so the ranks must make as many passes. Ranks hold equally many samples, so a
    # rank can always reach a count that another rank has.
    groups = list(groups)
    while len(groups) < target:
        tokens = [int(lengths[g].sum()) if len(g) > 1 else -1 for g in groups]
        widest = max(range(len(groups)), key=tokens.__getitem__)
        group = groups.pop(widest)
        cumulative = lengths[group].cumsum(0)
        cut = int((cumulative < cumulative[-1] / 2).sum().clamp(1, len(group) - 1))
        groups[widest:widest] = [group[:cut], group[cut:]]
    return groups
