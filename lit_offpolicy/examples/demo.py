"""``make demo``: SFT warm-up of the built-in tiny Llama, then TOPR on 2-digit addition, on a CPU.

Runs the same commands a user would, each in its own process, every one seeded by ``--seed``::

    lit-offpolicy create-tiny-model outputs/tiny-init --seed N
    lit-offpolicy fit --config configs/sft_tiny.yaml --seed_everything N --data.seed N  # -> outputs/sft-tiny
    lit-offpolicy fit --config configs/topr.yaml --config configs/demo.yaml \
        --seed_everything N --data.seed N                                              # -> outputs/logs/rl

The RL stage is TOPR with a group baseline and DAPO's group filter (``configs/demo.yaml``).

The warm-up stops once greedy validation accuracy reaches 0.4; RL stops once it has held 0.9 for 3
evaluations in a row (the Rollout's ``validation: {stop_at: 0.9, stop_after: 3}``). The demo then
reads ``val/accuracy`` from the RL run's TensorBoard logs, prints the curve and the timings, and writes
``outputs/demo_summary.json`` and ``outputs/demo_val_accuracy.png``: it writes under ``outputs/`` only.
``python -m lit_offpolicy.examples.demo --update-readme-image`` copies that picture to the README's
``docs/images/demo_val_accuracy.png``, deliberately.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

from lit_offpolicy.core.tensorboard import latest_run, read_scalars

OUTPUTS = Path("outputs")
PLOT = OUTPUTS / "demo_val_accuracy.png"
README_IMAGE = Path("docs/images/demo_val_accuracy.png")
TARGET = 0.9  # the val/accuracy RL must reach and hold (configs/demo.yaml: validation.stop_at)
HOLD = 3  # ... for this many evaluations in a row (validation.stop_after)
MIN_CLIMB = 0.3  # the least val/accuracy gain of the RL stage that counts as RL's doing
RL_CONFIGS = ("configs/topr.yaml", "configs/demo.yaml")  # the RL stage's --config files, in order
DEMO_SEEDS = (0, 1, 2, 3, 4)  # the seeds whose full runs the README lists (tests: the first and last)


def run_stage(name: str, *args: str) -> float:
    """Run ``python -m lit_offpolicy ARGS``; fail loudly if it fails; return its wall time in seconds."""
    print(f"\n=== {name}: lit-offpolicy {' '.join(args)}", flush=True)
    started = time.perf_counter()
    subprocess.run([sys.executable, "-m", "lit_offpolicy", *args], check=True)
    return time.perf_counter() - started


def summarize(curve: list[tuple[int, float]]) -> dict:
    """The RL curve's figures: start, peak, final, first step at or above the target, and success."""
    values = [value for _, value in curve]
    first = next((step for step, value in curve if value >= TARGET), None)
    held = len(values) >= HOLD and all(value >= TARGET for value in values[-HOLD:])
    return {
        "start": values[0],
        "peak": max(values),
        "final": values[-1],
        "first_step_at_target": first,
        "last_step": curve[-1][0],
        "passed": held and max(values) - values[0] >= MIN_CLIMB,
    }


def plot(curve: list[tuple[int, float]], path: Path, seed: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot([step for step, _ in curve], [value for _, value in curve], marker="o")
    ax.axhline(TARGET, color="grey", linestyle="--", linewidth=1)
    ax.set(xlabel="RL step (TOPR)", ylabel="val/accuracy (greedy exact match)", ylim=(0, 1))
    ax.set_title(f"Tiny Llama, 2-digit addition: TOPR after SFT (CPU, seed {seed})")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run_demo(seed: int) -> dict:
    # the demo's own start; earlier runs' models and checkpoints stay (each run keeps what it made)
    shutil.rmtree(OUTPUTS / "tiny-init", ignore_errors=True)
    seeded = ("--seed_everything", str(seed), "--data.seed", str(seed))
    timings = {
        "create": run_stage(
            "tiny model", "create-tiny-model", str(OUTPUTS / "tiny-init"), "--seed", str(seed)
        ),
        "sft": run_stage("SFT warm-up", "fit", "--config", "configs/sft_tiny.yaml", *seeded),
        "rl": run_stage("TOPR", "fit", *(arg for c in RL_CONFIGS for arg in ("--config", c)), *seeded),
    }
    curve = read_scalars(latest_run(OUTPUTS / "logs" / "rl"), "val/accuracy")
    plot(curve, PLOT, seed)
    summary = {
        "seed": seed,
        **summarize(curve),
        "val_accuracy": dict(curve),
        "seconds": {name: round(value, 1) for name, value in timings.items()},
        "total_seconds": round(sum(timings.values()), 1),
    }
    (OUTPUTS / "demo_summary.json").write_text(json.dumps(summary, indent=2))
    return summary


def report(summary: dict) -> None:
    print("\n=== demo: val/accuracy by RL step")
    for step, value in summary["val_accuracy"].items():
        print(f"  step {step:4d}  {value:.3f}")
    print(
        f"=== start {summary['start']:.3f}, first ≥ {TARGET} at step {summary['first_step_at_target']}, "
        f"peak {summary['peak']:.3f}, final {summary['final']:.3f} at step {summary['last_step']}"
    )
    print(f"=== seconds: {summary['seconds']}  total {summary['total_seconds']}")
    print(f"=== plot: {PLOT}  summary: {OUTPUTS / 'demo_summary.json'}")


def main(args: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m lit_offpolicy.examples.demo", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--seed", type=int, default=0, help="seeds model init, data order and sampling")
    parser.add_argument(
        "--update-readme-image",
        action="store_true",
        help=f"only copy {PLOT} (from the last demo run) to {README_IMAGE}",
    )
    options = parser.parse_args(args)
    if options.update_readme_image:
        if not PLOT.is_file():
            raise SystemExit(f"demo: no {PLOT} yet; run `make demo` first")
        shutil.copyfile(PLOT, README_IMAGE)
        print(f"demo: copied {PLOT} to {README_IMAGE}")
        return
    summary = run_demo(options.seed)
    report(summary)
    if not summary["passed"]:
        print(
            f"=== demo: val/accuracy did not climb by {MIN_CLIMB} to {TARGET} or above and hold it for "
            f"{HOLD} evaluations (from {summary['start']:.3f}, peak {summary['peak']:.3f}, "
            f"final {summary['final']:.3f})",
            file=sys.stderr,
        )
        raise SystemExit(1)


if __name__ == "__main__":
    main()
