"""Reward functions: the ``RewardFn`` protocol and its registry, verifiers for exact and ``\\boxed{}``
answers, isolation, and ``RewardConfig`` (the callbacks' ``reward`` option)."""

from lit_offpolicy.rewards.config import RewardConfig
from lit_offpolicy.rewards.isolation import IsolatedReward
from lit_offpolicy.rewards.verifiers import REWARDS, BoxedMath, ExactAnswer, RewardFn, RewardOutput

__all__ = [
    "REWARDS",
    "BoxedMath",
    "ExactAnswer",
    "IsolatedReward",
    "RewardConfig",
    "RewardFn",
    "RewardOutput",
]
