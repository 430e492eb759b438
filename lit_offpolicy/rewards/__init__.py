"""Reward functions: the contract (TRL's calling convention), the registry of built-ins (exact and
``\\boxed{}`` answers, math-verify, GSM8K, a format regex, a reward model), weighted sums, isolation,
and ``RewardConfig`` (the callbacks' ``reward`` option)."""

from lit_offpolicy.rewards.code import CodeExecutionReward
from lit_offpolicy.rewards.config import RewardConfig
from lit_offpolicy.rewards.contract import (
    RewardContractError,
    RewardFailure,
    RewardInputs,
    RewardOutput,
    RewardWorkersDied,
    WeightedRewards,
    completion_text,
    count_metrics,
    failure_summary,
    function_metrics,
    unscored_fraction,
)
from lit_offpolicy.rewards.isolation import IsolatedReward
from lit_offpolicy.rewards.judge import JudgeReward
from lit_offpolicy.rewards.math import GSM8KAnswer, MathVerify
from lit_offpolicy.rewards.model_reward import ModelReward
from lit_offpolicy.rewards.sandbox import Sandbox, SandboxLimits, SandboxUnavailable
from lit_offpolicy.rewards.verifiers import REWARDS, BoxedMath, ExactAnswer, FormatReward, RewardFn

__all__ = [
    "CodeExecutionReward",
    "Sandbox",
    "SandboxLimits",
    "SandboxUnavailable",
    "REWARDS",
    "BoxedMath",
    "ExactAnswer",
    "FormatReward",
    "GSM8KAnswer",
    "IsolatedReward",
    "JudgeReward",
    "MathVerify",
    "ModelReward",
    "RewardConfig",
    "RewardContractError",
    "RewardFailure",
    "RewardWorkersDied",
    "RewardFn",
    "RewardInputs",
    "RewardOutput",
    "WeightedRewards",
    "completion_text",
    "failure_summary",
    "count_metrics",
    "function_metrics",
    "unscored_fraction",
]
