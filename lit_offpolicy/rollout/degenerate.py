"""A run's guard against a reward that gives nothing to learn from: one line per metric that holds its
degenerate value (a fraction at 1, a spread of 0) for several RL steps in a row."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class Degenerate:
    """One reward metric's degenerate value, what it means and its likely cause."""

    metric: str
    holds: Callable[[float], bool]
    meaning: str
    cause: str


def _all(value: float) -> bool:
    return value >= 1.0


def _none(value: float) -> bool:
    return value <= 0.0


DEGENERATE = (
    Degenerate(
        "reward/malformed_fraction",
        _all,
        "no completion is in the form its reward reads (code: a ```python block; gsm8k: a '#### N' line; "
        "math_verify: a final answer), so every sample scores 0",
        "the policy never writes that form; warm it up with SFT on answers written in it "
        "(configs/recipes/code_sft_cpu.yaml does so for code, docs/recipes.md)",
    ),
    Degenerate(
        "reward/judge_unparsed_fraction",
        _all,
        "no answer of the judge matches its parser, so the judge scores no sample",
        "the judge does not answer in the parser's format: a model not trained to grade, a template that "
        "does not ask for the format, or max_new_tokens too short for it; train a grader "
        "(configs/recipes/judge_sft_cpu.yaml, docs/recipes.md) or change the parser",
    ),
    Degenerate(
        "reward/unscored_fraction",
        _all,
        "no sample got a value from any reward function",
        "every function raised, timed out or returned None (see reward/fn/<name>/error_fraction and "
        "none_fraction); the run stops after reward.max_failed_steps such steps",
    ),
    Degenerate(
        "reward/std",
        _none,
        "every sample got the same reward, so a group baseline's advantages are 0 and nothing is learned",
        "a task too hard (all 0) or too easy for the policy, a reward that ignores the completion, or "
        "samples that cannot differ (sampling.n 1, temperature 0)",
    ),
)


class DegenerateRewardDetector:
    """Counts, per ``DEGENERATE`` metric, the RL steps in a row at its degenerate value; warns once
    per metric when the count reaches ``steps``. A step without the metric breaks its run."""

    def __init__(self, steps: int = 5, signs: tuple[Degenerate, ...] = DEGENERATE) -> None:
        self.steps, self.signs = steps, signs
        self.held = {sign.metric: 0 for sign in signs}
        self.warned: set[str] = set()

    def observe(self, step: int, metrics: dict[str, float]) -> list[str]:
        """Take one RL step's metrics; a one-line warning for each metric that just held ``steps`` steps."""
        lines = []
        for sign in self.signs:
            value = metrics.get(sign.metric)
            self.held[sign.metric] = (
                self.held[sign.metric] + 1 if value is not None and sign.holds(value) else 0
            )
            if self.held[sign.metric] == self.steps and sign.metric not in self.warned:
                self.warned.add(sign.metric)
                lines.append(self._message(sign, value, step, metrics.get("reward/mean")))
        return lines

    def _message(self, sign: Degenerate, value: float, step: int, reward_mean: float | None) -> str:
        mean = "" if reward_mean is None else f", reward/mean {reward_mean:.3g}"
        return (
            f"lit-offpolicy: warning: degenerate reward: {sign.metric} has been {value:.3g} for "
            f"{self.steps} RL steps in a row (to step {step}{mean}): {sign.meaning}. Likely cause: "
            f"{sign.cause}. Warned once."
        )
