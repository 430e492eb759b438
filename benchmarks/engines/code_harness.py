"""``CodeExecutionReward`` samples scored per second: one harness run per sample vs one sandbox run per test.

The same reward scores the same batches at ``reward.workers: 2`` (``IsolatedReward``, as training
does), in the same run: ``ours`` runs a sample's tests in one sandbox run of the trusted harness
(``lit_offpolicy.rewards.code_harness``), each test in a child of its own; the baseline runs each test
as a sandbox run of its own, as the reward did before issue 48 (``OneRunPerTest`` below, the old
scoring: exit status 0 and, for stdin tests, the expected stdout). Completions are correct solutions,
which both must score 1.0. Batches, each scored ``--repeats`` times per variant (interleaved), the
median rate kept:

- ``code_tiny``: tests/fixtures/code_tiny.jsonl (16 MBPP-layout problems, 3 asserts each);
- ``apps``: synthetic APPS-layout problems (``input_output``, 20 stdin/stdout tests each);
- every ``*.jsonl`` of ``--fixtures`` (rows with ``solution``; default tests/fixtures/code_benchmarks:
  the canonical solutions of 100 HumanEval and 100 MBPP problems).

    python -m benchmarks.engines.code_harness [--repeats 3] [--apps 8] [--fixtures DIR]
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from benchmarks import REPO
from benchmarks.common import entry, median, timed
from benchmarks.results import record
from lit_offpolicy.rewards import CodeExecutionReward, IsolatedReward, RewardInputs, WeightedRewards
from lit_offpolicy.rewards.code import CodeTest, TestOutcome

NAME = "code_reward_harness_vs_one_run_per_test"
WORKERS = 2
FIXTURES = REPO / "tests" / "fixtures"
TINY = FIXTURES / "code_tiny.jsonl"
APPS_SOLUTION = "```python\nn = int(input())\nprint(sum(map(int, input().split())) * n)\n```"


class OneRunPerTest(CodeExecutionReward):
    """The reward as it was before the harness: every test a sandbox run of its own."""

    def run_tests(self, tests: list[CodeTest]) -> list[TestOutcome]:
        outcomes = []
        for test in tests:
            result = self.sandbox.run(test.program, test.stdin)
            passed = result.succeeded and test.passed(result.stdout)
            outcomes.append(TestOutcome(passed, "passed" if passed else "failed"))
        return outcomes


def apps_rows(count: int, tests: int = 20) -> list[dict]:
    """``count`` APPS-layout problems of ``tests`` stdin/stdout pairs each (n, then n numbers)."""
    rows = []
    for problem in range(count):
        inputs = [f"{k + 1}\n{' '.join(str(problem + i) for i in range(k + 1))}\n" for k in range(tests)]
        outputs = [f"{sum(problem + i for i in range(k + 1)) * (k + 1)}\n" for k in range(tests)]
        rows.append(
            {"input_output": json.dumps({"inputs": inputs, "outputs": outputs}), "solution": APPS_SOLUTION}
        )
    return rows


def batch(rows: list[dict]) -> RewardInputs:
    """Each row once, its ``solution`` the completion (the other fields are the reward's columns)."""
    problems = [
        {"prompt": "p", "answer": "", "columns": {k: v for k, v in row.items() if k != "solution"}}
        for row in rows
    ]
    return RewardInputs.of(problems, [row["solution"] for row in rows], [[0]] * len(rows))


def rate(reward: IsolatedReward, inputs: RewardInputs) -> float:
    """Samples per second of one scoring of ``inputs``; every sample must score 1.0."""
    seconds, out = timed(lambda: reward(inputs))
    if out.scores != [1.0] * len(inputs):
        raise RuntimeError(f"a correct solution scored below 1.0: {out.scores}")
    return len(inputs) / seconds


def main(repeats: int = 3, apps: int = 8, fixtures: Path | None = FIXTURES / "code_benchmarks") -> list[dict]:
    batches = {
        "code_tiny": batch([json.loads(line) for line in TINY.read_text().splitlines()]),
        "apps": batch(apps_rows(apps)),
    }
    for path in sorted(fixtures.glob("*.jsonl")) if fixtures else []:
        batches[path.stem] = batch([json.loads(line) for line in path.read_text().splitlines()])
    variants = {
        "ours": IsolatedReward(
            WeightedRewards({"code": CodeExecutionReward()}), timeout=3600.0, num_workers=WORKERS
        ),
        "baseline": IsolatedReward(
            WeightedRewards({"code": OneRunPerTest()}), timeout=3600.0, num_workers=WORKERS
        ),
    }
    rates = {variant: {name: [] for name in batches} for variant in variants}
    try:
        for reward in variants.values():
            rate(reward, batches["code_tiny"].select(range(4)))  # the workers start
        for _ in range(repeats):
            for name, inputs in batches.items():
                for variant, reward in variants.items():
                    rates[variant][name].append(rate(reward, inputs))
    finally:
        for reward in variants.values():
            reward.close()
    medians = {
        variant: {name: round(median(r), 2) for name, r in by.items()} for variant, by in rates.items()
    }
    return [
        entry(
            f"{NAME}_{name}",
            "samples/s",
            medians["ours"][name],
            medians["baseline"][name],
            repeats,
            threads=1,
            load_average=round(os.getloadavg()[0], 1),  # the machine may be shared: how busy it was
            workload=f"{len(batches[name])} correct {name} solutions, reward.workers {WORKERS}, timeout_s 10",
            what="ours: one sandbox run of the harness per sample; baseline: one sandbox run per test",
        )
        for name in batches
    ]


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--apps", type=int, default=8, help="synthetic APPS problems (20 stdin tests each)")
    parser.add_argument(
        "--fixtures", type=Path, default=FIXTURES / "code_benchmarks", help="*.jsonl problems with a solution"
    )
    args = parser.parse_args()
    record(main(args.repeats, args.apps, args.fixtures))
