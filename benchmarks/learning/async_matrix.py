"""Learning test of asynchronous rollouts (issue #38): does reward rise in every cell of the matrix?

Cells: {sync, async k=1, async k=2} × sampling temperature {0.7, 1.0} × rollout correction {none,
seq_is_rs}. Each cell and seed is one fresh process of ``configs/topr.yaml`` from the demo's SFT
warm-up: 64 prompts × 4 samples per RL step, no evaluation, no checkpoint. From its TensorBoard log,
start = mean ``reward/mean`` over RL steps 0–4, end = mean over the last 10 steps; a run passes
iff end > start. Every run uses one torch/OpenMP thread (async runs need it: producer and trainer
are two threads of one process, see benchmarks/learning/async_vs_sync.py), sync runs too, so cells compare.

    python -m benchmarks.learning.async_matrix            # 12 cells × 3 seeds, 100 steps each: about 1 h
    python -m benchmarks.learning.async_matrix --quick    # 4 cells, seed 0, 100 steps: about 5 min
    python -m benchmarks.learning.async_matrix --quick --jobs 2 --sft-dir DIR   # .ci/run: about 2.5 min

``--quick`` runs sync/T0.7/none, async_k1/T0.7/none, async_k2/T0.7/none and async_k1/T1.0/none.
Times on a 2-core x86_64: the 4 runs took 262 s one at a time and 137 s two at a time (``--jobs 2``, one
thread each), with the same start and end in every cell (the runs are seeded); earlier, beside another
training run, 6 min 36 s and 7 min 17 s. The full matrix is estimated from these (36 runs). Without
``outputs/sft-tiny`` (``--sft-dir``) the warm-up is trained first into the work directory (seed 0,
about 2 min more). Exit status 1, naming them, if any cell failed in any seed. A full run records
``async_learning_matrix`` in benchmarks/results.json (ours: cells that passed in every seed,
baseline: cells run, target ratio 1); ``--quick`` and ``--no-record`` record nothing.
"""

from __future__ import annotations

import argparse
import copy
import itertools
import os
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from benchmarks import REPO
from benchmarks.common import entry, median, timed
from benchmarks.learning import positive_int
from benchmarks.learning.async_vs_sync import MODES, fit_topr, rollout_callback, warm_up
from benchmarks.results import record
from lit_offpolicy.core.tensorboard import latest_run, read_scalars

Cell = tuple[str, float, str]  # (mode, temperature, correction)
DEFAULT_MODES = ["sync", "async_k1", "async_k2"]
DEFAULT_TEMPERATURES = [0.7, 1.0]
DEFAULT_CORRECTIONS = ["none", "seq_is_rs"]
QUICK_CELLS: list[Cell] = [
    ("sync", 0.7, "none"),
    ("async_k1", 0.7, "none"),
    ("async_k2", 0.7, "none"),
    ("async_k1", 1.0, "none"),
]
START_STEPS, END_STEPS = 5, 10  # start: RL steps 0..4; end: the last 10 logged steps
THREADS = 1


def matrix(modes: list[str], temperatures: list[float], corrections: list[str]) -> list[Cell]:
    """Every (mode, temperature, correction), in that nesting order."""
    return list(itertools.product(modes, temperatures, corrections))


def start_end(curve: list[tuple[int, float]]) -> tuple[float, float]:
    """(mean value over steps 0..START_STEPS−1, mean over the last END_STEPS points) of (step, value)."""
    first = [value for step, value in curve if step < START_STEPS]
    last = [value for _, value in sorted(curve)[-END_STEPS:]]
    if not first or not last:
        raise ValueError(f"no reward/mean at steps 0..{START_STEPS - 1} or at all: {curve[:3]}")
    return sum(first) / len(first), sum(last) / len(last)


def passes(start: float | None, end: float | None) -> bool:
    """The pass rule: reward at the end above its start (a run that crashed has neither: fails)."""
    return start is not None and end is not None and end > start


def label(cell: Cell) -> str:
    mode, temperature, correction = cell
    return f"{mode}/T{temperature}/{correction}"


def table(results: dict[Cell, dict[int, tuple[float | None, float | None]]], seeds: list[int]) -> str:
    """Markdown: one row per cell, "start → end" per seed ("crashed" where it did) and seeds passed."""
    lines = [
        "| mode | temperature | correction | " + " | ".join(f"seed {s}" for s in seeds) + " | passed |",
        "|---|---:|---|" + "---|" * len(seeds) + "---:|",
    ]
    for cell, by_seed in results.items():
        mode, temperature, correction = cell
        shown = [
            "crashed" if by_seed[s][0] is None else f"{by_seed[s][0]:.3f} → {by_seed[s][1]:.3f}"
            for s in seeds
        ]
        won = sum(passes(*by_seed[s]) for s in seeds)
        lines.append(
            f"| {mode} | {temperature} | {correction} | " + " | ".join(shown) + f" | {won}/{len(seeds)} |"
        )
    return "\n".join(lines)


def failing(results: dict[Cell, dict[int, tuple[float | None, float | None]]]) -> list[str]:
    """ "mode/T/correction (seeds …)" of every cell that failed in some seed."""
    out = []
    for cell, by_seed in results.items():
        lost = [seed for seed, (start, end) in by_seed.items() if not passes(start, end)]
        if lost:
            out.append(f"{label(cell)} (seed {', '.join(map(str, lost))})")
    return out


def train(cell: Cell, seed: int, sft: Path, work: Path, steps: int) -> Path:
    """One run of the cell; returns its TensorBoard run directory."""
    mode, temperature, correction = cell
    rollout = copy.deepcopy(rollout_callback(MODES[mode]))
    rollout["init_args"]["sampling"]["temperature"] = temperature
    # every_n_steps 0: no evaluation at all, so nothing can stop the run before max_steps
    rollout["init_args"]["validation"] = {"every_n_steps": 0, "stop_at": None}
    name = f"{label(cell).replace('/', '_')}_seed{seed}"
    seeded = ["--seed_everything", str(seed), "--data.seed", str(seed)]  # as the demo seeds
    corrected = [] if correction == "none" else ["--model.init_args.rollout_correction", correction]
    fit_topr(sft, work, name, [rollout], steps, THREADS, "--data.batch_size", "64", *seeded, *corrected)
    return latest_run(work / "logs" / name)


def run_cell(cell: Cell, seed: int, sft: Path, work: Path, steps: int) -> dict:
    """start, end, passed and seconds of one run (start and end None if it crashed or stopped early)."""

    def start_and_end() -> tuple[float | None, float | None]:
        try:
            curve = read_scalars(train(cell, seed, sft, work, steps), "reward/mean")
            if len(curve) != steps:
                raise RuntimeError(f"{len(curve)} reward/mean points for {steps} steps")
            return start_end(curve)
        except (subprocess.CalledProcessError, OSError, RuntimeError, ValueError) as error:
            print(f"=== {label(cell)} seed {seed}: {error}", flush=True)
            return None, None

    seconds, (start, end) = timed(start_and_end)
    result = {"start": start, "end": end, "passed": passes(start, end), "seconds": round(seconds, 1)}
    shown = "crashed" if start is None else f"start {start:.3f} end {end:.3f}"
    print(
        f"=== {cell[0]} T={cell[1]} {cell[2]} seed {seed}: {shown} "
        f"{'PASS' if result['passed'] else 'FAIL'} ({seconds:.0f} s)",
        flush=True,
    )
    return result


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--steps", type=positive_int, default=100, help="RL steps per run")
    parser.add_argument("--modes", nargs="+", choices=list(MODES), default=DEFAULT_MODES)
    parser.add_argument("--temperatures", type=float, nargs="+", default=DEFAULT_TEMPERATURES)
    parser.add_argument("--corrections", nargs="+", default=DEFAULT_CORRECTIONS, help="none or a preset")
    parser.add_argument(
        "--sft-dir", type=Path, default=REPO / "outputs" / "sft-tiny", help="built if missing"
    )
    parser.add_argument("--jobs", type=positive_int, default=1, help="runs at the same time")
    parser.add_argument("--work", type=Path, default=None, help="logs (default: a new temp dir)")
    parser.add_argument("--no-record", action="store_true", help="leave results.json alone")
    parser.add_argument(
        "--quick",
        action="store_true",
        help="CI: seed 0, 100 steps, the 4 QUICK_CELLS (over --seeds, --steps, --modes...); no record",
    )
    args = parser.parse_args(argv)
    if args.quick:
        args.seeds, args.steps = [0], 100
    return args


def cells_of(args: argparse.Namespace) -> list[Cell]:
    return list(QUICK_CELLS) if args.quick else matrix(args.modes, args.temperatures, args.corrections)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    started = time.perf_counter()
    work = args.work or Path(tempfile.mkdtemp(prefix="async_matrix_"))
    work.mkdir(parents=True, exist_ok=True)
    sft = args.sft_dir
    if not sft.is_dir():
        print(f"=== no SFT warm-up at {sft}: training one into {work} (seed 0)", flush=True)
        sft = warm_up(work, os.cpu_count() or 1)  # alone on the machine: every core
    cells = cells_of(args)
    runs = [(cell, seed) for cell in cells for seed in args.seeds]
    print(f"=== {len(runs)} runs of {args.steps} steps from {sft}, logs in {work}", flush=True)
    with ThreadPoolExecutor(max_workers=args.jobs) as pool:
        done = list(pool.map(lambda run: run_cell(*run, sft, work, args.steps), runs))
    outcome = {run: result for run, result in zip(runs, done, strict=True)}
    results = {
        cell: {s: (outcome[cell, s]["start"], outcome[cell, s]["end"]) for s in args.seeds} for cell in cells
    }
    print(f"\n{table(results, args.seeds)}\n")
    lost = failing(results)
    print(f"=== {len(runs)} runs in {time.perf_counter() - started:.0f} s")
    if not (args.quick or args.no_record):
        command = " ".join(
            ["python -m benchmarks.learning.async_matrix", *(sys.argv[1:] if argv is None else argv)]
        )
        record([result_entry(cells, args, outcome, lost, command)])
    if lost:
        print(f"=== async_matrix FAILED: reward did not rise in {'; '.join(lost)}", flush=True)
        return 1
    print(f"=== async_matrix passed: reward rose in all {len(cells)} cells", flush=True)
    return 0


def result_entry(
    cells: list[Cell], args: argparse.Namespace, outcome: dict, lost: list[str], command: str
) -> dict:
    """The results.json entry: ours = cells passed in every seed, baseline = cells run (ratio 1: all)."""
    passed = len(cells) - len(lost)
    return entry(
        "async_learning_matrix",
        "cells",
        ours=passed,
        baseline=len(cells),
        repeats=len(args.seeds),
        threads=THREADS,  # the runs' thread count, not this process's
        target=1.0,
        command=command,
        workload=f"demo TOPR from the SFT warm-up, 64 prompts x 4 samples per step, {args.steps} steps, "
        "HF engine, no evaluation; a cell passes iff mean reward/mean of the last 10 steps > of steps "
        "0-4, in every seed",
        median_seconds_per_run=median([result["seconds"] for result in outcome.values()]),
        cells={label(cell): {str(seed): outcome[cell, seed] for seed in args.seeds} for cell in cells},
    )


if __name__ == "__main__":
    sys.exit(main())
