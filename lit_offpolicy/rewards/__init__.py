"""Reward functions: the ``RewardFn`` protocol, verifiers for exact and ``\\boxed{}`` answers, isolation."""

from lit_offpolicy.rewards.isolation import IsolatedReward
from lit_offpolicy.rewards.verifiers import (
    REWARD_FNS,
    BoxedMath,
    ExactAnswer,
    RewardFn,
    RewardOutput,
    get_reward_fn,
)

__all__ = [
    "REWARD_FNS",
    "BoxedMath",
    "ExactAnswer",
    "IsolatedReward",
    "RewardFn",
    "RewardOutput",
    "get_reward_fn",
]
