"""Group filtering: DAPO's dynamic-sampling filter, which drops groups whose rewards are all equal.

Under a group baseline (GRPO, RLOO, Dr. GRPO) a group whose samples all got the same reward has zero
advantage everywhere, so it adds cost to the update and no signal (Yu et al. 2025, "DAPO: An
Open-Source LLM Reinforcement Learning System at Scale", §3.2; verl's ``filter_groups``).
"""

from __future__ import annotations

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
