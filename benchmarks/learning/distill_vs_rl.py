"""On-policy distillation against RL alone, from the same SFT warm-up, on the demo's addition task.

1. The demo's first two stages (seed 0): the tiny Llama, its SFT warm-up, then the demo's RL run
   (TOPR, ``configs/topr.yaml`` + ``configs/demo.yaml``), whose exported actor is the teacher.
2. For each seed, from the warm-up, ``configs/distill.yaml`` twice, the same in everything but the
   advantage: the teacher alone (``distill.task_coef: 0``), and RL alone (no teacher, the exact-answer
   reward's GRPO advantage: ``distill.teacher_path: null, task_coef: 1``). Each evaluates greedy
   ``val/accuracy`` every 10 steps on the held-out problems and stops once 0.9 has held 3 times.

Each stage is a ``lit-offpolicy fit`` process in a directory of its own. Printed and recorded
(results.json ``distill_vs_rl``): per seed and arm the curve, its end (the mean of its last 5
evaluations) and its first step at ≥ 0.9; the ratio is distillation's median end over RL's. (The
first measured run, 200 steps an arm, had neither arm reach 0.9 in any seed, so the end is the
figure; steps to 0.9 are kept beside it.) Figures, never a test.

    python -m benchmarks.learning.distill_vs_rl --seeds 0 1 2 --steps 200
    python -m benchmarks.learning.distill_vs_rl --quick       # 1 seed, short teacher, 10 steps each: it runs
    python -m benchmarks.learning.distill_vs_rl --summarize DIR   # the entry of runs kept with --keep DIR
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks import REPO, repo_env
from benchmarks.common import machine, median
from benchmarks.results import record
from lit_offpolicy.core.tensorboard import latest_run, read_scalars

TARGET = 0.9
LAST = 5  # evaluations (every 10 steps) at the end of each curve: the arm's end accuracy
ARMS = {  # the model's distill group of each arm (given whole: a dotted `...distill.teacher_path null` is
    # read by jsonargparse 4.53 as the string "None")
    "distill": lambda teacher: {"teacher_path": str(teacher), "coef": 1.0, "task_coef": 0.0},
    "rl": lambda teacher: {"teacher_path": None, "coef": 1.0, "task_coef": 1.0},
}


def fit(work: Path, name: str, *args: str) -> Path:
    """``lit-offpolicy fit ARGS`` in ``work/name`` (its outputs/ there); the directory."""
    directory = work / name
    directory.mkdir(parents=True)
    print(f"=== {name}: lit-offpolicy fit {' '.join(args)}", flush=True)
    with (directory / "fit.log").open("w") as log:
        subprocess.run(
            [sys.executable, "-m", "lit_offpolicy", "fit", *args],
            cwd=directory,
            stdout=log,
            stderr=subprocess.STDOUT,
            check=True,
            env=repo_env(),
        )
    return directory


def warm_up_and_teacher(work: Path, teacher_steps: int) -> tuple[Path, Path]:
    """The SFT warm-up and the teacher (the demo's RL result), both from seed 0."""
    subprocess.run(
        [sys.executable, "-m", "lit_offpolicy", "create-tiny-model", str(work / "tiny-init"), "--seed", "0"],
        check=True,
        stdout=subprocess.DEVNULL,
    )
    seeded = ("--seed_everything", "0", "--data.seed", "0")
    sft = fit(
        work, "sft", "--config", str(REPO / "configs" / "sft_tiny.yaml"), "--model.init_args.model_path",
        str(work / "tiny-init"), *seeded,
    )  # fmt: skip
    warm_up = sft / "outputs" / "sft-tiny"
    rl_configs = [
        arg for config in ("topr.yaml", "demo.yaml") for arg in ("--config", str(REPO / "configs" / config))
    ]
    teacher_run = fit(
        work, "teacher", *rl_configs, "--model.init_args.model_path", str(warm_up),
        "--trainer.max_steps", str(teacher_steps), *seeded,
    )  # fmt: skip
    return warm_up, teacher_run / "outputs" / "actor"


def arm(
    work: Path, name: str, seed: int, warm_up: Path, teacher: Path, steps: int
) -> list[tuple[int, float]]:
    """One arm's run from the warm-up; its ``val/accuracy`` curve."""
    seeded = ("--seed_everything", str(seed), "--data.seed", str(seed))
    distill = json.dumps(ARMS[name](teacher))
    directory = fit(
        work, f"{name}_seed{seed}", "--config", str(REPO / "configs" / "distill.yaml"),
        "--model.init_args.model_path", str(warm_up), "--model.init_args.distill", distill,
        "--trainer.max_steps", str(steps), *seeded,
    )  # fmt: skip
    return curve_of(directory)


def first_at_target(curve: list[tuple[int, float]]) -> int | None:
    return next((step for step, value in curve if value >= TARGET), None)


def end_of(curve: list[tuple[int, float]]) -> float:
    """The mean ``val/accuracy`` of the curve's last ``LAST`` evaluations: where the arm ended."""
    return sum(value for _, value in curve[-LAST:]) / len(curve[-LAST:])


def main(
    seeds: list[int], steps: int = 200, teacher_steps: int = 500, quick: bool = False, keep: str | None = None
) -> list[dict]:
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(keep or tmp)
        warm_up, teacher = warm_up_and_teacher(work, teacher_steps)
        curves = {
            name: {seed: arm(work, name, seed, warm_up, teacher, steps) for seed in seeds} for name in ARMS
        }
        teacher_curve = curve_of(work / "teacher")
    entry = summarize(curves, teacher_curve, steps, teacher_steps, quick)
    if quick:  # a smoke run: its figures are not recorded (``benchmarks.run`` records what is returned)
        return []
    record([entry])
    return [entry]


def summarize(curves: dict, teacher_curve: list, steps: int, teacher_steps: int, quick: bool = False) -> dict:
    """The results.json entry of the arms' ``val/accuracy`` curves (``{arm: {seed: curve}}``)."""
    reached = {
        name: {seed: first_at_target(curve) for seed, curve in runs.items()} for name, runs in curves.items()
    }
    for name, runs in curves.items():
        for seed, curve in runs.items():
            points = ", ".join(f"{step}: {value:.3f}" for step, value in curve)
            print(f"=== {name} seed {seed}: first ≥ {TARGET} at step {reached[name][seed]}; {points}")
    ends = {name: {seed: end_of(curve) for seed, curve in runs.items()} for name, runs in curves.items()}
    medians = {name: median(by_seed.values()) for name, by_seed in ends.items()}
    seeds = sorted(next(iter(curves.values())))
    entry = {
        "name": "distill_vs_rl",
        "unit": f"val/accuracy, mean of the last {LAST} evaluations",
        "ours": round(medians["distill"], 4),
        "baseline": round(medians["rl"], 4),
        "ratio": round(medians["distill"] / medians["rl"], 3),
        "repeats": len(seeds),
        "machine": machine(),
        "end_accuracy": {
            name: {str(s): round(v, 4) for s, v in by_seed.items()} for name, by_seed in ends.items()
        },
        f"first_step_at_{TARGET}": {
            name: {str(s): v for s, v in by_seed.items()} for name, by_seed in reached.items()
        },
        "teacher_val_accuracy_last": teacher_curve[-1][1] if teacher_curve else None,
        "val_accuracy": {name: {str(s): dict(c) for s, c in runs.items()} for name, runs in curves.items()},
        "workload": f"configs/distill.yaml from the SFT warm-up (seed 0), {steps} steps an arm; teacher: the "
        f"demo's TOPR run (seed 0, at most {teacher_steps} steps); the median over seeds of each arm's end",
        "baseline_is": "RL alone: the same config without the teacher (the exact reward's GRPO advantage)",
        "command": "python -m benchmarks.learning.distill_vs_rl"
        + (
            " --quick"
            if quick
            else f" --seeds {' '.join(map(str, seeds))} --steps {steps} --teacher-steps {teacher_steps}"
        ),
    }
    print(json.dumps(entry))
    return entry


def curve_of(run: Path) -> list[tuple[int, float]]:
    """The ``val/accuracy`` curve of a kept run directory."""
    return read_scalars(latest_run(run / "outputs" / "logs" / "rl"), "val/accuracy")


def summarize_kept(work: Path, steps: int, teacher_steps: int) -> list[dict]:
    """The entry of runs kept with ``--keep`` (e.g. after changing ``summarize``), recorded."""
    runs = sorted(work.glob("*_seed*"))
    curves: dict[str, dict[int, list]] = {}
    for run in runs:
        name, seed = run.name.rsplit("_seed", 1)
        curves.setdefault(name, {})[int(seed)] = curve_of(run)
    entry = summarize(curves, curve_of(work / "teacher"), steps, teacher_steps)
    record([entry])
    return [entry]


if __name__ == "__main__":
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=200, help="most RL steps of each arm")
    parser.add_argument("--teacher-steps", type=int, default=500, help="most steps of the teacher's RL run")
    parser.add_argument("--quick", action="store_true", help="1 seed, a 10-step teacher, 10 steps an arm")
    parser.add_argument("--keep", metavar="DIR", help="work in DIR (new) and keep the runs")
    parser.add_argument("--summarize", metavar="DIR", help="record the entry of runs kept in DIR; run none")
    options = parser.parse_args()
    if options.summarize:
        summarize_kept(Path(options.summarize), options.steps, options.teacher_steps)
        sys.exit(0)
    if options.quick:
        options.seeds, options.steps, options.teacher_steps = [0], 10, 10
    main(options.seeds, options.steps, options.teacher_steps, options.quick, options.keep)
