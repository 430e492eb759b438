"""``CodeExecutionReward`` throughput: samples scored per second at ``reward.workers: 2`` on real problems.

The problems are ``tests/fixtures/code_benchmarks/`` (HumanEval and MBPP rows, README.md there), each
scored with its canonical solution as the completion, one batch per layout through ``IsolatedReward``
as training scores a step. Figures: samples per second per layout and overall (all samples over the
time of all batches), the median of ``repeats``, with the 1-minute load average at the end (the
machine may be shared).

``baseline`` is the figure recorded before one harness ran a sample's tests (issue 48: one sandbox
run per test); a later run keeps it from results.json and puts its own figure in ``ours``.

    python -m benchmarks.code_reward [--repeats 3] [--rebaseline]
"""

from __future__ import annotations

import argparse
import json
import os
import time

from benchmarks.common import entry, median
from benchmarks.results import RESULTS, record
from lit_offpolicy.rewards import CodeExecutionReward, IsolatedReward, RewardInputs, WeightedRewards
from tests.helpers.code_benchmarks import COLUMNS, problems, reward_problem

NAME = "code_reward_samples_per_s"
WORKERS = 2


def batch(layout: str) -> RewardInputs:
    """The layout's problems, each with its canonical solution as the one completion."""
    rows = problems(layout)
    return RewardInputs.of(
        [reward_problem(layout, row) for row in rows], [row["solution"] for row in rows], [[0]] * len(rows)
    )


def samples_per_s(reward: IsolatedReward, inputs: RewardInputs) -> tuple[float, float]:
    """(samples per second, seconds) of scoring ``inputs`` once; every sample must score 1.0."""
    started = time.perf_counter()
    out = reward(inputs)
    seconds = time.perf_counter() - started
    if out.scores != [1.0] * len(inputs):
        raise RuntimeError(f"a canonical solution scored below 1.0: {out.scores}")
    return len(inputs) / seconds, seconds


def recorded_baseline() -> dict:
    """The baseline fields of this benchmark's entry in results.json (empty if there is none)."""
    entries = json.loads(RESULTS.read_text()) if RESULTS.exists() else []
    old = next((e for e in entries if e["name"] == NAME), {})
    return {key: old[key] for key in ("baseline", "baseline_load_average") if key in old}


def main(repeats: int = 3, rebaseline: bool = False) -> list[dict]:
    batches = {layout: batch(layout) for layout in COLUMNS}
    reward = IsolatedReward(
        WeightedRewards({"code": CodeExecutionReward()}), timeout=3600.0, num_workers=WORKERS
    )
    try:
        samples_per_s(reward, batches["humaneval"])  # the workers start and warm up
        rates: dict[str, list[float]] = {layout: [] for layout in batches}
        overall: list[float] = []
        for _ in range(repeats):
            seconds = 0.0
            for layout, inputs in batches.items():
                rate, spent = samples_per_s(reward, inputs)
                rates[layout].append(rate)
                seconds += spent
            overall.append(sum(map(len, batches.values())) / seconds)
    finally:
        reward.close()
    ours, load = median(overall), round(os.getloadavg()[0], 1)  # the machine is shared: say how busy
    kept = {} if rebaseline else recorded_baseline()
    return [
        entry(
            NAME,
            "samples/s",
            ours,
            kept.get("baseline", ours),
            repeats,
            threads=1,
            load_average=load,
            baseline_load_average=kept.get("baseline_load_average", load),
            per_layout={layout: round(median(r), 2) for layout, r in rates.items()},
            workload=(
                f"canonical solutions of {', '.join(f'{len(b)} {layout}' for layout, b in batches.items())} "
                f"problems (tests/fixtures/code_benchmarks), one batch per layout, reward.workers {WORKERS}"
            ),
            what="baseline: one sandbox run per test (issue 48 before); ours: this run",
        )
    ]


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--rebaseline", action="store_true", help="record this run's figure as the baseline")
    args = parser.parse_args()
    record(main(args.repeats, args.rebaseline))
