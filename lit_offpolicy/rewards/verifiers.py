"""Verifiable rewards: score each response 1.0 (correct) or 0.0 (wrong) against its reference answer.

A reward function never raises on what the policy wrote: a response it cannot read scores 0.0 and
is counted in ``num_malformed``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from fractions import Fraction
from typing import Protocol

from lit_offpolicy.registry import Registry


@dataclass(frozen=True)
class RewardOutput:
    """One score per response; how many responses were malformed, and (isolated scoring,
    ``IsolatedReward``) how many scored 0 because the function raised or ran out of time."""

    scores: list[float]
    num_malformed: int
    num_errors: int = 0
    num_timeouts: int = 0


class RewardFn(Protocol):
    def __call__(self, responses: list[str], answers: list[str]) -> RewardOutput: ...


REWARDS: Registry[RewardFn] = Registry("reward")
"""Short names of the reward functions (``@REWARDS.register("name")`` on the class or function)."""


@REWARDS.register("exact")
class ExactAnswer:
    """Correct when the response, cut at the first ``eos_token`` or newline and stripped, equals the answer.

    An empty (or non-string) response is malformed.
    """

    def __init__(self, eos_token: str = "<eos>"):
        self.eos_token = eos_token

    def __call__(self, responses: list[str], answers: list[str]) -> RewardOutput:
        _check_lengths(responses, answers)
        scores, num_malformed = [], 0
        for response, answer in zip(responses, answers, strict=True):
            extracted = self.extract(response)
            num_malformed += not extracted
            scores.append(float(bool(extracted) and extracted == str(answer).strip()))
        return RewardOutput(scores, num_malformed)

    def extract(self, response: object) -> str:
        if not isinstance(response, str):
            return ""
        if self.eos_token:
            response = response.split(self.eos_token, 1)[0]
        return response.split("\n", 1)[0].strip()


@REWARDS.register("boxed")
class BoxedMath:
    """Correct when the last ``\\boxed{...}`` matches the answer.

    Both sides lose their whitespace; when both parse as numbers (integers, decimals, ``a/b``) they
    are compared exactly as fractions, otherwise as strings. No (complete) box is malformed.
    """

    def __call__(self, responses: list[str], answers: list[str]) -> RewardOutput:
        _check_lengths(responses, answers)
        scores, num_malformed = [], 0
        for response, answer in zip(responses, answers, strict=True):
            boxed = last_boxed(response) if isinstance(response, str) else None
            num_malformed += boxed is None
            scores.append(float(boxed is not None and answers_match(boxed, str(answer))))
        return RewardOutput(scores, num_malformed)


BOX = "\\boxed{"


def last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}``, braces balanced; ``None`` if absent or never closed."""
    start = text.rfind(BOX)
    if start < 0:
        return None
    depth = 1
    for index in range(start + len(BOX), len(text)):
        depth += {"{": 1, "}": -1}.get(text[index], 0)
        if depth == 0:
            return text[start + len(BOX) : index]
    return None


def answers_match(predicted: str, reference: str) -> bool:
    predicted, reference = _normalise(predicted), _normalise(reference)
    predicted_number, reference_number = _number(predicted), _number(reference)
    if predicted_number is not None and reference_number is not None:
        return predicted_number == reference_number
    return predicted == reference


def _normalise(text: str) -> str:
    return "".join(text.split())


_NUMBER = re.compile(r"[+-]?(?:\d+(?:\.\d*)?|\.\d+)(?:/\d+)?")


def _number(text: str) -> Fraction | None:
    """Integers, decimals and ``a/b`` (no exponents: ``1e999999999`` must not hang the reward)."""
    if not _NUMBER.fullmatch(text):
        return None
    try:
        return Fraction(text)
    except (ValueError, ZeroDivisionError):
        return None


def _check_lengths(responses: list, answers: list) -> None:
    if len(responses) != len(answers):
        raise ValueError(f"got {len(responses)} responses but {len(answers)} answers")
