"""DAPO's dynamic sampling: drop the groups whose rewards are all equal, and re-sample to make up for them.

Under a group baseline (GRPO, RLOO, Dr. GRPO) a group whose samples all got the same reward has zero
advantage everywhere, so it adds cost to the update and no signal (Yu et al. 2025, "DAPO: An
Open-Source LLM Reinforcement Learning System at Scale", §3.2; verl's ``filter_groups``). DAPO then
samples more prompts until the step holds its batch of informative groups (verl's
``max_num_gen_batches``); here each extra round is sized from the informative rate seen so far.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence

import torch
from torch import Tensor

from lit_offpolicy.advantages.shaping import group_index


def informative_samples(scores: Tensor, group_ids: Tensor) -> Tensor:
    """Per sample (bool): whether its group's scores are not all equal (max > min over the group).

    A group of one sample is never informative. Groups are given by ``group_ids`` (any order).
    """
    if scores.shape != group_ids.shape or scores.dim() != 1:
        raise ValueError(
            f"scores {list(scores.shape)} and group_ids {list(group_ids.shape)} must be one value per sample"
        )
    group = group_index(group_ids, len(scores), scores.device)
    count = int(group.max()) + 1 if len(group) else 0
    high = torch.full((count,), -torch.inf, dtype=scores.dtype, device=scores.device)
    low = torch.full((count,), torch.inf, dtype=scores.dtype, device=scores.device)
    high = high.scatter_reduce(0, group, scores, "amax")
    low = low.scatter_reduce(0, group, scores, "amin")
    return (high > low)[group]


ROUND_GROWTH_LIMIT = 4
"""A re-sampling round draws at most this many times the step's target of informative groups."""


def next_round_size(target: int, informative: int, sampled: int) -> int:
    """Prompts for DAPO's next dynamic-sampling round: the shortfall of informative groups
    (``target − informative``) divided by the step's informative rate so far (``informative /
    sampled`` prompts), with 20% to spare, at most ``ROUND_GROWTH_LIMIT × target``."""
    if informative >= target:
        return 0
    limit = ROUND_GROWTH_LIMIT * target
    if informative == 0:
        return limit
    return min(math.ceil(1.2 * (target - informative) * sampled / informative), limit)


def draw_problems(problems: Sequence[dict], count: int, seed: str) -> list[dict]:
    """``count`` problems drawn uniformly with replacement, the same for the same ``seed``."""
    if not problems:
        raise ValueError("no training problems to draw re-sampling prompts from")
    return random.Random(seed).choices(problems, k=count)
