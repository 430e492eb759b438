"""Reward functions: the ``RewardFn`` protocol and verifiers for exact and ``\\boxed{}`` answers."""

from lit_offpolicy.rewards.verifiers import (
    REWARD_FNS,
    BoxedMath,
    ExactAnswer,
    RewardFn,
    RewardOutput,
    get_reward_fn,
)

__all__ = ["REWARD_FNS", "BoxedMath", "ExactAnswer", "RewardFn", "RewardOutput", "get_reward_fn"]
