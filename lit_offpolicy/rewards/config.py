"""``RewardConfig``: which reward functions score the completions, their weights, and the isolation."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from lit_offpolicy.core.checks import check_choice, check_range
from lit_offpolicy.rewards.contract import RewardInputs, RewardOutput, WeightedRewards
from lit_offpolicy.rewards.isolation import START_METHODS, IsolatedReward
from lit_offpolicy.rewards.verifiers import REWARDS

RewardSpec = str | Callable[..., Any]
"""One reward function: a short name, an import path, a class_path mapping or the object itself."""


@dataclass(frozen=True)
class RewardConfig:
    """The reward: one function or a weighted sum of several, in worker processes under a deadline.

    Each function follows TRL's convention (``lit_offpolicy.rewards.contract``): called with
    ``prompts``, ``completions``, ``completion_ids`` and the data row's columns as keyword lists, it
    returns one float or None per completion.
    """

    fn: str | list[str | Callable[..., Any]] | Callable[..., Any] = "exact"
    """A short name ("exact", "boxed"), an import path "pkg.module:name" (a class is built with its
    defaults, a function is used as it is), an object given by class_path and init_args, or a list
    of these, summed with ``weights``. Each is logged as ``reward/fn/<name>/mean``."""
    weights: list[float] | None = None
    """One weight per function in ``fn`` (TRL's ``reward_weights``); None: all 1."""
    timeout: float | None = 60.0
    """Seconds a batch's scoring may take. The functions then run in ``workers`` processes
    (``IsolatedReward``): a sample whose scoring raises or runs out of time scores 0 and is counted
    in ``reward/error_fraction`` or ``reward/timeout_fraction``. None: in the trainer's process."""
    workers: int = 1
    """Worker processes that score a batch's samples in parallel (with a timeout)."""
    start_method: str = "fork"
    """How the workers start: "fork" (fast; one torch thread each) or "forkserver"/"spawn" (fresh
    interpreters, for rewards that start threads or run a torch model, such as ``ModelReward``, which
    refuses "fork"; give functions by import path)."""

    max_worker_restarts: int = 3
    """A worker that dies while scoring (the kernel's OOM killer, a crash in C code) is replaced and its
    samples scored again, counted in ``reward/worker_restarts``; after this many deaths in a row with
    nothing scored between them, the run stops with one line naming the function."""

    max_failed_steps: int = 3
    """Stop the run (``last.ckpt`` saved, one line naming the functions) after this many steps in a row
    in which no sample got a value from any function (each raised, timed out or returned None)."""

    def __post_init__(self) -> None:
        check_range("reward.max_failed_steps", self.max_failed_steps, low=1)
        check_range("reward.max_worker_restarts", self.max_worker_restarts, low=0)
        if self.timeout is not None:
            check_range("reward.timeout", self.timeout, low=0.0, low_inclusive=False)
        check_range("reward.workers", self.workers, low=1)
        check_choice("reward.start_method", self.start_method, START_METHODS)
        specs = self.fn if isinstance(self.fn, list) else [self.fn]
        if self.weights is not None and len(self.weights) != len(specs):
            raise ValueError(
                f"reward.weights has {len(self.weights)} values for {len(specs)} reward functions in "
                "reward.fn; give one weight per function"
            )

    def build(self) -> Callable[[RewardInputs], RewardOutput]:
        """The weighted functions, wrapped in an ``IsolatedReward`` when ``timeout`` is set."""
        specs = self.fn if isinstance(self.fn, list) else [self.fn]
        functions: dict[str, Callable] = {}
        for spec in specs:
            if hasattr(spec, "as_dict") and not callable(spec):  # a class_path the parser left unbuilt
                spec = spec.as_dict()
            name = reward_name(spec)
            unique, copy = name, 1
            while unique in functions:
                copy += 1
                unique = f"{name}_{copy}"
            functions[unique] = REWARDS.resolve(spec, option="reward.fn")
            if isinstance(spec, str) and ":" in spec:
                check_not_factory(spec, functions[unique])
        rewards = WeightedRewards(functions, self.weights)
        if self.timeout is None:
            return rewards
        unsafe = [name for name, fn in functions.items() if not getattr(fn, "fork_safe", True)]
        if unsafe and self.start_method == "fork":
            raise ValueError(
                f"reward.fn {unsafe[0]!r} runs a torch model, which hangs or fails in a worker forked from "
                "the trainer: set reward.start_method: spawn (or forkserver), or reward.timeout: null to "
                "score in the trainer's process"
            )
        return IsolatedReward(
            rewards, self.timeout, self.workers, self.start_method, max_restarts=self.max_worker_restarts
        )


def reward_name(spec: RewardSpec | Mapping) -> str:
    """The name a reward is logged under: a short name as it is, an import path's or class_path's
    last part, an object's ``__name__`` or class name."""
    if isinstance(spec, str):
        return spec.replace(":", ".").rsplit(".", 1)[-1]
    if isinstance(spec, Mapping) and "class_path" in spec:
        return str(spec["class_path"]).replace(":", ".").rsplit(".", 1)[-1]
    return getattr(spec, "__name__", type(spec).__name__)


def check_not_factory(path: str, fn: Callable) -> None:
    """Refuse a function given by import path that cannot take a reward's keywords (no ``completions``,
    no ``**kwargs``): most likely a factory that returns the reward, such as TRL's
    ``get_soft_overlong_punishment(max_completion_len, soft_punish_cache)``."""
    if not inspect.isfunction(fn):
        return
    parameters = inspect.signature(fn).parameters
    if "completions" in parameters or any(p.kind is p.VAR_KEYWORD for p in parameters.values()):
        return
    dotted = path.replace(":", ".")
    args = ", ".join(f"{name}: ..." for name in parameters)
    raise ValueError(
        f"reward.fn={path!r} takes ({', '.join(parameters)}), not a reward's completions and **kwargs: "
        f"if it builds the reward function, give it as {{class_path: {dotted}, init_args: {{{args}}}}}"
    )
