"""The reward contract: TRL's calling convention, so a reward function written for TRL works unchanged.

A reward function is called on a batch of completions with keyword arguments (TRL's ``GRPOTrainer``
convention; every list has one entry per completion, a prompt's entries repeated for its samples):

- ``prompts``: the prompt as the data row holds it (a string, or a list of chat messages);
- ``completions``: the sampled text; ``[{"role": "assistant", "content": text}]`` where the prompt
  is chat messages (as TRL passes conversational completions);
- ``completion_ids``: the sampled token ids;
- every other column of the data row, as stored (nested columns stay nested), and ``answer``: the
  row's reference answer as ``data.answer_key`` selects it.

It returns one float or ``None`` per completion (``None``: this reward does not apply to the row),
or a ``RewardOutput`` (our built-ins: it also counts unreadable completions). Several functions are
summed with weights (``WeightedRewards``); a ``None`` adds nothing to the sum and is left out of
that function's ``reward/fn/<name>/mean``.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

RESERVED = ("prompts", "completions", "completion_ids")
"""Keyword arguments the trainer fills; a data column of the same name is not passed."""


@dataclass(frozen=True)
class RewardOutput:
    """The scores of a batch of N completions and what went wrong scoring them."""

    scores: list[float]
    """[N]: one score per completion."""
    num_malformed: int
    """Completions the reward could not read."""
    num_errors: int = 0
    """Completions that scored 0 because a function raised (isolated scoring, ``IsolatedReward``)."""
    num_timeouts: int = 0
    """Completions that scored 0 because the batch ran out of time (``IsolatedReward``)."""
    worker_restarts: int = 0
    """Worker processes that died while scoring and were replaced (``IsolatedReward``)."""
    by_function: dict[str, list[float | None]] = field(default_factory=dict)
    """Each function's own [N] values by name (``None`` where it did not apply, raised or timed out)."""
    errors_by_function: dict[str, int] = field(default_factory=dict)
    """Completions on which each function raised, by name (isolated scoring)."""
    first_error: str | None = None
    """The batch's first failure, ``'name' raised Type: message`` (isolated scoring)."""
    counts: dict[str, int] = field(default_factory=dict)
    """Completions a function counted under a name of its own (``JudgeReward``'s ``judge_unparsed``),
    logged as ``reward/<name>_fraction``."""


class RewardContractError(ValueError):
    """A reward function broke the contract (wrong count, not a number): a bug to fix, not a sample to
    score 0, so it stops the run."""


class RewardWorkersDied(RewardContractError):
    """Reward worker processes died ``reward.max_worker_restarts`` + 1 times in a row, no chunk scored
    between: the function ends every process it runs in, so the run stops with one line naming it."""


class RewardFailure(RewardContractError):
    """No sample of ``reward.max_failed_steps`` steps in a row got a value from any reward function
    (each raised, ran out of time or returned None): the run stops, its message naming the functions
    (or the agent, ``option`` "agent.fn", whose every episode failed)."""

    def __init__(self, message: str, option: str = "reward.fn") -> None:
        super().__init__(message)
        self.option = option


@dataclass(frozen=True)
class RewardInputs:
    """What the reward functions of one batch are called with, one entry per completion (N)."""

    prompts: list
    """[N]: the prompt as the data row holds it (a string, or chat messages)."""
    completions: list[str]
    """[N]: the sampled text."""
    completion_ids: list[list[int]]
    """[N]: the sampled token ids."""
    columns: dict[str, list] = field(default_factory=dict)
    """The data rows' other columns by name (``answer`` among them), each [N]."""

    def __len__(self) -> int:
        return len(self.completions)

    @classmethod
    def of(
        cls, problems: Sequence[dict], texts: list[str], token_ids: list[list[int]], n: int = 1
    ) -> RewardInputs:
        """Inputs for ``n`` completions of each problem (the data module's rows, in order)."""
        if len(texts) != len(problems) * n or len(token_ids) != len(texts):
            raise ValueError(f"{len(texts)} completions for {len(problems)} prompts × {n} samples")
        columns = [reward_columns(problem) for problem in problems]  # once per problem, not per sample
        names = dict.fromkeys(name for row in columns for name in row)
        return cls(
            prompts=[p.get("raw_prompt", p["prompt"]) for p in problems for _ in range(n)],
            completions=list(texts),
            completion_ids=[list(ids) for ids in token_ids],
            columns={name: [row.get(name) for row in columns for _ in range(n)] for name in names},
        )

    def select(self, indices: Sequence[int]) -> RewardInputs:
        return RewardInputs(
            prompts=[self.prompts[i] for i in indices],
            completions=[self.completions[i] for i in indices],
            completion_ids=[self.completion_ids[i] for i in indices],
            columns={name: [values[i] for i in indices] for name, values in self.columns.items()},
        )

    def kwargs(self) -> dict[str, list]:
        """The keyword arguments of a call: completions in chat form where the prompt is messages."""
        completions = [
            [{"role": "assistant", "content": text}] if isinstance(prompt, list) else text
            for prompt, text in zip(self.prompts, self.completions, strict=True)
        ]
        return {
            **self.columns,
            "prompts": self.prompts,
            "completions": completions,
            "completion_ids": self.completion_ids,
        }


def reward_columns(problem: dict) -> dict[str, Any]:
    """A problem's columns for the reward: its row's (``columns``, set by the data module) and
    ``answer``; a built-in task's problem has only its answer."""
    columns = {k: v for k, v in problem.get("columns", {}).items() if k not in RESERVED}
    columns["answer"] = problem["answer"]
    return columns


def completion_text(completion: str | list[dict]) -> str:
    """The text of a completion in either form (a string, or TRL's chat form: the last message's)."""
    if isinstance(completion, list):
        return str(completion[-1].get("content", "")) if completion else ""
    return completion if isinstance(completion, str) else ""


def call_reward(
    name: str, fn: Callable, inputs: RewardInputs
) -> tuple[list[float | None], int, dict[str, int]]:
    """``fn``'s values (a float or None per completion; NaN/inf raise ``ValueError``), its count of
    malformed completions and its named counts (``RewardOutput.counts``); ``RewardContractError`` when
    it returns anything else."""
    output = fn(**inputs.kwargs())
    malformed, counts = 0, {}
    if isinstance(output, RewardOutput):
        output, malformed, counts = output.scores, output.num_malformed, output.counts
    if not isinstance(output, (list, tuple)) and not hasattr(output, "tolist"):
        raise RewardContractError(
            f"reward {name!r} returned a {type(output).__name__}; expected a list with one float or None "
            "per completion"
        )
    values = output.tolist() if hasattr(output, "tolist") else list(output)
    if len(values) != len(inputs):
        raise RewardContractError(
            f"reward {name!r} returned {len(values)} values for {len(inputs)} completions; expected one "
            "float or None per completion"
        )
    for value in values:
        if value is not None and (isinstance(value, bool) or not isinstance(value, numbers.Real)):
            raise RewardContractError(
                f"reward {name!r} returned {value!r} ({type(value).__name__}); expected a float or None"
            )
        if value is not None and not math.isfinite(value):
            raise ValueError(f"reward {name!r} returned the non-finite score {value}")
    return [None if value is None else float(value) for value in values], malformed, dict(counts)


class WeightedRewards:
    """The weighted sum of named reward functions (TRL's ``reward_funcs`` with ``reward_weights``).

    score = Σ_f w_f · r_f over the functions whose value is not None (0 where none applies).
    """

    def __init__(self, functions: dict[str, Callable], weights: Sequence[float] | None = None) -> None:
        if not functions:
            raise ValueError("reward.fn: no reward function given")
        weights = [1.0] * len(functions) if weights is None else [float(w) for w in weights]
        if len(weights) != len(functions):
            raise ValueError(
                f"reward.weights has {len(weights)} values for {len(functions)} reward functions; "
                "give one weight per function"
            )
        self.functions = dict(functions)
        self.weights = dict(zip(self.functions, weights, strict=True))

    def __call__(self, inputs: RewardInputs, catch_errors: bool = False) -> RewardOutput:
        """The weighted scores. ``catch_errors``: a function that raises (not a contract breach) gives
        None on the batch and is counted in ``errors_by_function``, and every score is 0."""
        by_function: dict[str, list[float | None]] = {}
        errors: dict[str, int] = {}
        first_error = None
        malformed = 0
        counts: dict[str, int] = {}
        for name, fn in self.functions.items():
            try:
                by_function[name], bad, counted = call_reward(name, fn, inputs)
            except RewardContractError:
                raise
            except Exception as error:
                if not catch_errors:
                    raise
                by_function[name], bad, counted = [None] * len(inputs), 0, {}
                errors[name] = len(inputs)
                first_error = first_error or f"{name!r} raised {type(error).__name__}: {error}"
            malformed = max(malformed, bad)
            for key, count in counted.items():
                counts[key] = counts.get(key, 0) + count
        scores = [
            0.0
            if errors
            else float(sum(self.weights[name] * v[i] for name, v in by_function.items() if v[i] is not None))
            for i in range(len(inputs))
        ]
        return RewardOutput(
            scores,
            malformed,
            by_function=by_function,
            errors_by_function=errors,
            first_error=first_error,
            counts=counts,
        )

    def close(self) -> None:
        """Release what a function holds (a reward model's workers, say) where it can be closed."""
        for fn in self.functions.values():
            close = getattr(fn, "close", None)
            if callable(close):
                close()


def function_metrics(outputs: Sequence[RewardOutput]) -> dict[str, float]:
    """Per function, under ``reward/fn/<name>/``: ``mean`` (over its values that are not None),
    ``error_fraction`` (samples it raised on) and ``none_fraction`` (samples it returned None for)."""
    sums: dict[str, float] = {}
    counts: dict[str, int] = {}
    errors: dict[str, int] = {}
    nones: dict[str, int] = {}
    total = 0
    for output in outputs:
        total += len(output.scores)
        for name, values in output.by_function.items():
            present = [v for v in values if v is not None]
            failed = output.errors_by_function.get(name, 0)
            sums[name] = sums.get(name, 0.0) + sum(present)
            counts[name] = counts.get(name, 0) + len(present)
            errors[name] = errors.get(name, 0) + failed
            nones[name] = nones.get(name, 0) + len(values) - len(present) - failed - output.num_timeouts
    metrics: dict[str, float] = {}
    for name in sums:
        if counts[name]:
            metrics[f"reward/fn/{name}/mean"] = sums[name] / counts[name]
        metrics[f"reward/fn/{name}/error_fraction"] = errors[name] / max(total, 1)
        metrics[f"reward/fn/{name}/none_fraction"] = max(nones[name], 0) / max(total, 1)
    return metrics


def count_metrics(outputs: Sequence[RewardOutput]) -> dict[str, float]:
    """``reward/<name>_fraction`` for each named count of the outputs (``RewardOutput.counts``)."""
    total = sum(len(output.scores) for output in outputs)
    sums: dict[str, int] = {}
    for output in outputs:
        for name, count in output.counts.items():
            sums[name] = sums.get(name, 0) + count
    return {f"reward/{name}_fraction": count / max(total, 1) for name, count in sums.items()}


def unscored_fraction(outputs: Sequence[RewardOutput]) -> float:
    """The share of samples that got a value from no reward function (each raised, timed out or
    returned None); 0 where the outputs name no function."""
    total = unscored = 0
    for output in outputs:
        if not output.by_function:
            return 0.0
        columns = list(output.by_function.values())
        total += len(output.scores)
        unscored += sum(all(values[i] is None for values in columns) for i in range(len(output.scores)))
    return unscored / total if total else 0.0


def failure_summary(outputs: Sequence[RewardOutput], timeout: float | None) -> str:
    """What made a step's samples unscored, naming each function (and ``reward.timeout`` for time-outs)."""
    names = list(dict.fromkeys(name for output in outputs for name in output.by_function))
    quoted = ", ".join(repr(name) for name in names)
    errors = [output.first_error for output in outputs if output.first_error]
    if errors:
        return f"reward {quoted} failed on every sample: {errors[0]}"
    if any(output.num_timeouts for output in outputs):
        return (
            f"reward {quoted} was not done within reward.timeout={timeout} s on every sample; raise "
            "reward.timeout or make the function faster"
        )
    return f"reward {quoted} returned None (does not apply) for every sample; check the columns it reads"
