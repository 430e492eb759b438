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
from lit_offpolicy.core.checks import check_range


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


def group_count(group_ids: Tensor) -> int:
    """How many groups (distinct ids) the samples belong to."""
    return len(torch.unique(group_ids))


def first_groups(group_ids: Tensor, count: int) -> Tensor:
    """Indices of the samples of the first ``count`` groups, in order of the groups' first samples."""
    order = torch.unique(group_ids, return_inverse=True)[1]
    positions = torch.arange(len(order), device=order.device)
    first_seen = torch.full((int(order.max()) + 1 if len(order) else 0,), len(order), device=order.device)
    first_seen = first_seen.scatter_reduce(0, order, positions, "amin")
    rank = first_seen.argsort().argsort()  # each group's position by its first sample
    return (rank[order] < count).nonzero().squeeze(1)


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
    return random.Random(seed).choices(_drawable(problems), k=count)


def _drawable(problems: Sequence[dict]) -> Sequence[dict]:
    if not problems:
        raise ValueError("no training problems to draw re-sampling prompts from")
    return problems


class PromptHistory:
    """GRESO's pre-rollout filter: a prompt is sampled again with probability ``explore ** z``.

    z: how many of the prompt's last groups in a row had equal rewards. Zheng et al. 2025, "Act Only
    When It Pays: Efficient Reinforcement Learning for LLM Reasoning via Selective Rollouts", §4.
    Prompts the policy always solves, or always fails, are then mostly skipped before generation
    instead of filtered after it.

    ``z`` (the prompt's zero-variance streak) is reset by an informative group. GRESO adapts
    ``explore`` to a target rate of zero-variance prompts; here it is fixed.
    """

    MAX_CANDIDATES_PER_PROMPT = 100
    """``draw`` looks at most this many candidates per prompt asked for, then draws without the filter."""

    def __init__(self, explore: float) -> None:
        self.explore = check_range("pre_rollout_filter", explore, low=0.0, high=1.0, low_inclusive=False)
        self.streaks: dict[str, int] = {}
        self.skipped = 0
        """Prompts skipped so far (not saved in checkpoints)."""

    def keep_probability(self, prompt: str) -> float:
        """``explore ** z`` for the prompt's zero-variance streak ``z`` (1 for a prompt not yet seen)."""
        return self.explore ** self.streaks.get(prompt, 0)

    def select(self, problems: Sequence[dict], rng: random.Random) -> list[dict]:
        """The problems that pass the filter (one draw of ``rng`` each, in order)."""
        kept = [p for p in problems if rng.random() < self.keep_probability(p["prompt"])]
        self.skipped += len(problems) - len(kept)
        return kept

    def draw(self, problems: Sequence[dict], count: int, rng: random.Random) -> list[dict]:
        """``count`` problems drawn uniformly with replacement among those that pass the filter; after
        ``MAX_CANDIDATES_PER_PROMPT × count`` candidates the rest are drawn without it."""
        problems = _drawable(problems)
        kept: list[dict] = []
        for _ in range(self.MAX_CANDIDATES_PER_PROMPT * count):
            if len(kept) == count:
                return kept
            kept += self.select([rng.choice(problems)], rng)
        return kept + rng.choices(problems, k=count - len(kept))

    def record(self, prompts: Sequence[str], informative: Sequence[bool]) -> None:
        """After sampling: each prompt's group was informative (streak back to 0) or not (streak + 1)."""
        for prompt, signal in zip(prompts, informative, strict=True):
            self.streaks[prompt] = 0 if signal else self.streaks.get(prompt, 0) + 1

    def state_dict(self) -> dict:
        return {"streaks": dict(self.streaks)}

    def load_state_dict(self, state_dict: dict) -> None:
        self.streaks = dict(state_dict["streaks"])
