"""Advantage estimation (GAE, REINFORCE, GRPO, RLOO, REINFORCE++) and reward/advantage shaping."""

from lit_offpolicy.advantages.estimators import (
    ADVANTAGES,
    GAE,
    GRPO,
    RLOO,
    Advantage,
    Reinforce,
    ReinforcePlusPlus,
)
from lit_offpolicy.advantages.shaping import (
    RunningMoments,
    clip_advantages,
    clip_rewards,
    normalize_rewards,
    overlong_penalty,
    token_level_rewards,
    whiten_advantages,
)

__all__ = [
    "ADVANTAGES",
    "GAE",
    "GRPO",
    "RLOO",
    "Advantage",
    "Reinforce",
    "ReinforcePlusPlus",
    "RunningMoments",
    "clip_advantages",
    "clip_rewards",
    "normalize_rewards",
    "overlong_penalty",
    "token_level_rewards",
    "whiten_advantages",
]
