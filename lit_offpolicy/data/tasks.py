"""Built-in arithmetic tasks: generated, deterministic, no download.

A task enumerates all of its problems once. The train/val split is fixed by a stable hash of the
prompt (about one problem in ten goes to validation), so the two sets are disjoint and the
validation set does not move with the seed; the seed only chooses which problems, in which order.
A task may weight its training stream: ``copies(prompt)`` is how often a problem appears in one
epoch (validation always counts each held-out problem once).
"""

from __future__ import annotations

import random
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from functools import cached_property

from lit_offpolicy.core.checks import check_choice

Problem = dict[str, object]
"""A row: ``prompt`` (a string, or chat messages as read from a file until set-up renders them) and
``answer`` (a string); from a file also ``columns`` (the row's other columns, for the reward
functions) and, after set-up, ``raw_prompt`` (the prompt as the row held it)."""
VAL_SHARE = 10  # one problem in VAL_SHARE (by prompt hash) is held out for validation


@dataclass(frozen=True)
class Task:
    """A finite set of ``{"prompt", "answer"}`` problems with a fixed train/val split."""

    name: str
    """The name a config gives (``data.task``)."""
    description: str
    """One line on what the problems are."""
    enumerate_problems: Callable[[], Iterator[tuple[str, str]]] = field(repr=False)
    """Every (prompt, answer) of the task, in a fixed order."""
    copies: Callable[[str], int] = field(default=lambda prompt: 1, repr=False)
    """How often a training prompt appears in one epoch (1 each by default)."""

    @cached_property
    def _pools(self) -> tuple[list[Problem], list[Problem]]:
        train, val = [], []
        for prompt, answer in self.enumerate_problems():
            is_val = zlib.crc32(prompt.encode()) % VAL_SHARE == 0
            (val if is_val else train).append({"prompt": prompt, "answer": answer})
        return train, val

    @cached_property
    def _epoch(self) -> list[Problem]:
        return [problem for problem in self._pools[0] for _ in range(self.copies(problem["prompt"]))]

    @property
    def train_size(self) -> int:
        """Distinct training problems."""
        return len(self._pools[0])

    @property
    def epoch_size(self) -> int:
        """Training problems in one epoch, each counted ``copies(prompt)`` times."""
        return len(self._epoch)

    @property
    def val_size(self) -> int:
        return len(self._pools[1])

    def train(self, n: int, seed: int = 0) -> list[Problem]:
        """``n`` training problems in a seeded order; beyond one epoch, the epoch repeats reshuffled."""
        pool = self._epoch
        rng = random.Random(f"{self.name}/train/{seed}")
        problems: list[Problem] = []
        while len(problems) < n:
            problems.extend(rng.sample(pool, len(pool)))
        return problems[:n]

    def val(self, n: int, seed: int = 0) -> list[Problem]:
        """``n`` distinct validation problems (at most the size of the held-out pool)."""
        pool = self._pools[1]
        if n > len(pool):
            raise ValueError(f"task {self.name!r} has {len(pool)} validation problems; asked for {n}")
        return random.Random(f"{self.name}/val/{seed}").sample(pool, n)


def _addition() -> Iterator[tuple[str, str]]:
    for a in range(100):
        for b in range(100):
            yield f"{a}+{b}=", str(a + b)


_MULTISTEP_FORMS: dict[str, Callable[[int, int, int], int]] = {
    "{a}+{b}*{c}=": lambda a, b, c: a + b * c,
    "{a}*{b}-{c}=": lambda a, b, c: a * b - c,
    "({a}+{b})*{c}=": lambda a, b, c: (a + b) * c,
    "({a}-{b})+{c}=": lambda a, b, c: a - b + c,
}


def _one_digit_operands_weighted(prompt: str) -> int:
    """4 copies per one-digit operand (``7+45=``: 4, ``7+5=``: 16, ``17+45=``: 1).

    Drawn uniformly from a, b in [0, 99], 19% of the problems have a one-digit operand and 1% two;
    the tiny demo model then learns them last: after RL on that mix, 98% of its two-digit problems
    were right and half of those with a one-digit operand (docs/demo.md). Weighted, the four operand
    lengths make 48% (two digits each), 21%, 21% and 9% (one digit each) of an epoch.
    """
    return 4 ** sum(len(operand) == 1 for operand in prompt[:-1].split("+"))


def _multistep() -> Iterator[tuple[str, str]]:
    for form, evaluate in _MULTISTEP_FORMS.items():
        for a in range(10):
            for b in range(10):
                for c in range(10):
                    yield form.format(a=a, b=b, c=c), str(evaluate(a, b, c))


TASKS: dict[str, Task] = {
    "addition": Task(
        "addition",
        "a+b= with a, b in [0, 99]; the answer is the sum; training oversamples one-digit operands 4x each",
        _addition,
        copies=_one_digit_operands_weighted,
    ),
    "multistep": Task(
        "multistep",
        "two operations on single digits, e.g. 3+4*5= or (7-9)+2=; the answer is an integer, maybe negative",
        _multistep,
    ),
}


def get_task(name: str) -> Task:
    """The built-in task called ``name``."""
    return TASKS[check_choice("task", name, TASKS)]
