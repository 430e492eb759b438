"""``RewardConfig``: which reward function scores the responses, and how it is isolated."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from lit_offpolicy.checks import check_choice, check_range
from lit_offpolicy.rewards.isolation import START_METHODS, IsolatedReward
from lit_offpolicy.rewards.verifiers import REWARDS, RewardFn


@dataclass(frozen=True)
class RewardConfig:
    """The reward: a function of (responses, answers), run in worker processes under a deadline."""

    fn: str | Callable[[list[str], list[str]], Any] = "exact"
    """A short name ("exact", "boxed"), an import path "pkg.module:name" (a class is built with its
    defaults, a function is used as it is), or an object given by class_path and init_args."""
    timeout: float | None = 60.0
    """Seconds a batch's scoring may take. The function then runs in ``workers`` processes
    (``IsolatedReward``): a sample that raises or runs out of time scores 0 and is counted in
    ``reward/error_fraction`` or ``reward/timeout_fraction``. None: in the trainer's process."""
    workers: int = 1
    """Worker processes that score a batch's samples in parallel (with a timeout)."""
    start_method: str = "fork"
    """How the workers start: "fork" (fast; one torch thread each) or "forkserver"/"spawn" (fresh
    interpreters, for rewards that start threads or use CUDA; the function must be importable)."""

    def __post_init__(self) -> None:
        if self.timeout is not None:
            check_range("reward.timeout", self.timeout, low=0.0, low_inclusive=False)
        check_range("reward.workers", self.workers, low=1)
        check_choice("reward.start_method", self.start_method, START_METHODS)

    def build(self) -> RewardFn:
        """The reward function, wrapped in an ``IsolatedReward`` when ``timeout`` is set."""
        fn = REWARDS.resolve(self.fn, option="reward.fn")
        if self.timeout is None:
            return fn
        return IsolatedReward(fn, self.timeout, self.workers, start_method=self.start_method)
