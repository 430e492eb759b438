"""Verifiable rewards: score each completion 1.0 (correct) or 0.0 (wrong) against the row's answer.

Built-in reward functions follow the reward contract (``lit_offpolicy.rewards.contract``, TRL's
convention): keyword lists ``completions`` and ``answer`` (the row's reference answer) among the
others. They never raise on what the policy wrote: a completion they cannot read scores 0.0 and is
counted in ``num_malformed``.
"""

from __future__ import annotations

import re
from fractions import Fraction
from typing import Any, Protocol

from lit_offpolicy.core.registry import Registry
from lit_offpolicy.rewards.contract import RewardOutput, completion_text


class RewardFn(Protocol):
    """A reward function: keyword lists ``prompts``, ``completions``, ``completion_ids`` and the
    data row's columns in; one float or None per completion (or a ``RewardOutput``) out."""

    def __call__(self, *, completions: list, **kwargs: Any) -> list[float | None] | RewardOutput: ...


REWARDS: Registry[RewardFn] = Registry("reward")
"""Short names of the reward functions (``@REWARDS.register("name")`` on the class or function)."""


@REWARDS.register("exact")
class ExactAnswer:
    """Correct when the response, cut at the first ``eos_token`` or newline and stripped, equals the answer.

    An empty (or non-string) response is malformed.
    """

    def __init__(self, eos_token: str = "<eos>"):
        self.eos_token = eos_token

    def __call__(self, completions: list, answer: list, **kwargs: Any) -> RewardOutput:
        _check_lengths(completions, answer)
        scores, num_malformed = [], 0
        for completion, reference in zip(completions, answer, strict=True):
            extracted = self.extract(completion_text(completion))
            num_malformed += not extracted
            scores.append(float(bool(extracted) and extracted == str(reference).strip()))
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

    def __call__(self, completions: list, answer: list, **kwargs: Any) -> RewardOutput:
        _check_lengths(completions, answer)
        scores, num_malformed = [], 0
        for completion, reference in zip(completions, answer, strict=True):
            boxed = last_boxed(completion_text(completion))
            num_malformed += boxed is None
            scores.append(float(boxed is not None and answers_match(boxed, str(reference))))
        return RewardOutput(scores, num_malformed)


@REWARDS.register("format")
class FormatReward:
    """1.0 when the completion's text matches ``pattern``, else 0.0.

    ``re.search`` with DOTALL, so ``.`` spans lines; anchor it with ``^...$`` to require the whole text.

    The default asks for the layout of DeepSeek-R1-Zero's training template, a reasoning block then
    an answer block: ``<think>...</think> <answer>...</answer>``, nothing before or after.
    """

    def __init__(self, pattern: str = r"^<think>.*?</think>\s*<answer>.*?</answer>$") -> None:
        try:
            self._regex = re.compile(pattern, re.DOTALL)
        except (re.error, TypeError) as error:
            raise ValueError(f"pattern={pattern!r} is not a regular expression: {error}") from None
        self.pattern = pattern

    def __call__(self, completions: list, **kwargs: Any) -> RewardOutput:
        texts = [completion_text(completion) for completion in completions]
        return RewardOutput([float(self._regex.search(text) is not None) for text in texts], 0)


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
    predicted, reference = _normalize(predicted), _normalize(reference)
    predicted_number, reference_number = _number(predicted), _number(reference)
    if predicted_number is not None and reference_number is not None:
        return predicted_number == reference_number
    return predicted == reference


def _normalize(text: str) -> str:
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


def _check_lengths(completions: list, answers: list) -> None:
    if len(completions) != len(answers):
        raise ValueError(f"got {len(completions)} completions but {len(answers)} answers")
