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


def by_prompt(prompts: list[list[int]], size: int | None) -> list[Tensor]:
    """``by_size`` over the samples taken prompt by prompt (``prompts``: each prompt's samples), so that
    a prompt's samples share micro-batches (``UpdateOptions.shared_prefix``); each in sample order."""
    order = torch.tensor([sample for samples in prompts for sample in samples], dtype=torch.long)
    return [order[group].sort().values for group in by_size(len(order), size)]


def by_token_budget(
    lengths: Tensor, budget: int, prompts: list[list[int]] | None = None, prompt_lengths: Tensor | None = None
) -> list[Tensor]:
    """Groups of at most ``budget`` tokens (Σ of their samples' ``lengths``), as few as first-fit
    decreasing finds: the longest sample first, each into the first group it fits in, else a new one.
    A sample longer than the budget is an error (one line, naming the option).

    With ``prompts`` (each prompt's samples) the units are a prompt's samples, costing its
    ``prompt_lengths`` once plus their responses (a shared-prefix row, ``training.shared_prefix``); a
    prompt whose samples exceed the budget is cut, in sample order, into as few units as fit."""
    longest = int(lengths.max()) if len(lengths) else 0
    if longest > budget:
        raise ValueError(
            f"update.max_tokens_per_micro_batch={budget} is smaller than a sample of {longest} tokens "
            "(prompt + response); allowed values: at least the longest prompt + sampling.max_tokens"
        )
    if prompts is None:
        units, costs = [[i] for i in range(len(lengths))], [int(n) for n in lengths]
    else:
        units, costs = _prompt_units(lengths, budget, prompts, prompt_lengths)
    groups: list[list[int]] = []
    room: list[int] = []
    for unit in torch.argsort(torch.tensor(costs, dtype=torch.long), descending=True, stable=True).tolist():
        cost = costs[unit]
        fit = next((g for g, free in enumerate(room) if free >= cost), None)
        if fit is None:
            groups.append([])
            room.append(budget)
            fit = len(groups) - 1
        groups[fit] += units[unit]
        room[fit] -= cost
    return [torch.tensor(sorted(group), dtype=torch.long) for group in groups]


def _prompt_units(
    lengths: Tensor, budget: int, prompts: list[list[int]], prompt_lengths: Tensor
) -> tuple[list[list[int]], list[int]]:
    """Each prompt's samples as units of at most ``budget`` tokens (the prompt once), and their costs."""
    units, costs = [], []
    for samples in prompts:
        prompt = int(prompt_lengths[samples[0]])
        unit, cost = [], prompt
        for sample in samples:
            response = int(lengths[sample]) - prompt
            if unit and cost + response > budget:
                units.append(unit)
                costs.append(cost)
                unit, cost = [], prompt
            unit.append(sample)
            cost += response
        units.append(unit)
        costs.append(cost)
    return units, costs


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
