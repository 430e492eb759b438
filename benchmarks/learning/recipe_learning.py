"""Learning test of the CPU recipes (issue #47): does each recipe's reward rise from its warm-up?

Each recipe runs the commands its config's header gives, in order, in a fresh work directory (which
sees the repository's ``configs/`` and ``tests/fixtures/``): the tiny model, the warm-up (seed 0), then
the RL run once per seed (``--seed_everything``). From the RL run's TensorBoard log, start = mean
``reward/mean`` over its first ``START_STEPS`` steps, end = mean over its last ``END_STEPS``; a run
passes iff end > start and its last greedy ``val/accuracy`` is above its first (before any update).

    python -m benchmarks.learning.recipe_learning          # both recipes, seeds 0 1 2: docs/recipes.md
    python -m benchmarks.learning.recipe_learning --quick --jobs 2  # seed 0 (.ci/run, --work DIR)

``--jobs 2`` runs the two recipes side by side, a recipe's commands still in order: each run computes
on one thread of its tiny model, so two take about the time of the longer (CI: 470 s against 679 s one
after the other), with the same figures as each alone.

Exit status 1, naming them, if a recipe failed in any seed.
"""

from __future__ import annotations

import argparse
import signal
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from benchmarks import REPO, repo_env
from benchmarks.learning import positive_int
from lit_offpolicy.core.tensorboard import latest_run, read_scalars

START_STEPS, END_STEPS = 5, 5


@dataclass(frozen=True)
class Recipe:
    """A recipe: the commands before its RL run (argvs of lit-offpolicy or python), then its RL config."""

    name: str
    prepare: tuple[tuple[str, ...], ...]
    config: str
    logs: str
    """The RL run's TensorBoard directory (save_dir/name), relative to the work directory."""


RECIPES = {
    "code": Recipe(
        "code",
        (
            ("lit-offpolicy", "create-tiny-model", "outputs/tiny-qwen2", "--arch", "qwen2"),
            ("lit-offpolicy", "fit", "--config", "configs/recipes/code_sft_cpu.yaml"),
        ),
        "configs/recipes/code_grpo_cpu.yaml",
        "outputs/code-tiny/logs/grpo",
    ),
    "judge": Recipe(
        "judge",
        (
            ("lit-offpolicy", "create-tiny-model", "outputs/tiny-init"),
            ("lit-offpolicy", "fit", "--config", "configs/sft_tiny.yaml"),
            ("python", "-m", "lit_offpolicy.examples.judge_data", "outputs/judge-data"),
            ("lit-offpolicy", "fit", "--config", "configs/recipes/judge_sft_cpu.yaml"),
        ),
        "configs/recipes/judge_grpo_cpu.yaml",
        "outputs/judge-tiny/logs/grpo",
    ),
}


@dataclass(frozen=True)
class Result:
    """One RL run: reward/mean's start and end (``start_end``), its first and last val/accuracy."""

    start: float
    end: float
    val_first: float
    val_last: float

    def __str__(self) -> str:
        return f"reward {self.start:.3f} → {self.end:.3f}, val {self.val_first:.3f} → {self.val_last:.3f}"


class Interrupted(Exception):
    """A recipe's command ended by Ctrl-C (SIGINT): the whole check stops, not only that run."""


RUNNING: set[subprocess.Popen] = set()
"""The recipes' commands running now (one per recipe at most)."""
STOPPING = threading.Event()
"""Set on Ctrl-C: no recipe starts another command."""


def run(argv: tuple[str, ...], work: Path) -> None:
    """One command of a recipe in ``work``, through this interpreter, quiet unless it fails."""
    if STOPPING.is_set():
        raise Interrupted(" ".join(argv))
    program, *rest = argv
    command = (
        [sys.executable, *rest] if program == "python" else [sys.executable, "-m", "lit_offpolicy", *rest]
    )
    if rest[0] == "fit":
        command += ["--trainer.enable_progress_bar", "false"]
    with subprocess.Popen(
        command, cwd=work, env=repo_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    ) as process:
        RUNNING.add(process)
        if STOPPING.is_set():  # Ctrl-C came as it started
            process.send_signal(signal.SIGINT)
        try:
            stdout, stderr = process.communicate()
        finally:
            RUNNING.discard(process)
    if STOPPING.is_set() or process.returncode in (-signal.SIGINT, 128 + signal.SIGINT):
        raise Interrupted(" ".join(argv))
    if process.returncode:
        tail = (stdout + stderr)[-3000:]
        raise RuntimeError(f"{' '.join(argv)} exited {process.returncode}:\n{tail}")


def stop_running() -> None:
    """Ctrl-C: start no other command and pass SIGINT on to the running ones (a terminal's Ctrl-C has
    reached them already; a SIGINT to this process alone has not)."""
    STOPPING.set()
    for process in list(RUNNING):
        process.send_signal(signal.SIGINT)


def workspace(root: Path, name: str) -> Path:
    """A fresh directory that sees the repository's configs and fixtures at the paths the recipes name."""
    work = root / name
    (work / "tests").mkdir(parents=True)
    (work / "configs").symlink_to(REPO / "configs")
    (work / "tests" / "fixtures").symlink_to(REPO / "tests" / "fixtures")
    return work


def start_end(curve: list[tuple[int, float]]) -> tuple[float, float]:
    """(mean of the first START_STEPS values, mean of the last END_STEPS) of a (step, value) curve."""
    values = [value for _, value in sorted(curve)]
    if len(values) < START_STEPS + END_STEPS:
        raise RuntimeError(f"{len(values)} reward/mean points: too few for a start and an end")
    return sum(values[:START_STEPS]) / START_STEPS, sum(values[-END_STEPS:]) / END_STEPS


def learn(recipe: Recipe, seed: int, work: Path, steps: int | None) -> Result:
    """One RL run of ``recipe`` from its warm-up in ``work``: its reward's start and end, its first and
    last val/accuracy."""
    fit = ("lit-offpolicy", "fit", "--config", recipe.config, "--seed_everything", str(seed))
    run(fit + (("--trainer.max_steps", str(steps)) if steps else ()), work)
    logs = latest_run(work / recipe.logs)
    accuracy = [value for _, value in sorted(read_scalars(logs, "val/accuracy"))]
    if len(accuracy) < 2:
        raise RuntimeError(f"{len(accuracy)} val/accuracy points: too few for a first and a last")
    return Result(*start_end(read_scalars(logs, "reward/mean")), accuracy[0], accuracy[-1])


def check(recipe: Recipe, seeds: list[int], root: Path, steps: int | None) -> dict[int, Result | None]:
    """Warm up once, then one RL run per seed; (start, end) per seed, None for a run that failed."""
    started = time.perf_counter()
    work = workspace(root, recipe.name)
    for command in recipe.prepare:
        run(command, work)
    print(f"=== {recipe.name}: warm-up done ({time.perf_counter() - started:.0f} s)", flush=True)
    results: dict[int, Result | None] = {}
    for seed in seeds:
        began = time.perf_counter()
        try:
            results[seed] = learn(recipe, seed, work, steps)
        except RuntimeError as error:
            print(f"=== {recipe.name} seed {seed}: {error}", flush=True)
            results[seed] = None
        shown = "failed" if results[seed] is None else str(results[seed])
        print(f"=== {recipe.name} seed {seed}: {shown} ({time.perf_counter() - began:.0f} s)", flush=True)
    return results


def passes(result: Result | None) -> bool:
    return result is not None and result.end > result.start and result.val_last > result.val_first


def table(results: dict[str, dict[int, Result | None]], seeds: list[int]) -> str:
    """Markdown: one row per recipe, reward/mean's and val/accuracy's "start → end" per seed."""
    lines = ["| recipe | " + " | ".join(f"seed {s}" for s in seeds) + " |", "|---|" + "---|" * len(seeds)]
    for name, by_seed in results.items():
        shown = ["failed" if by_seed[s] is None else str(by_seed[s]) for s in seeds]
        lines.append(f"| {name} | " + " | ".join(shown) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.learning.recipe_learning",
        description=__doc__.split("\n")[0],
        epilog="Exit status 1, naming them, if a recipe did not learn in a seed; 130 on Ctrl-C.",
    )
    parser.add_argument(
        "--recipes", nargs="+", choices=list(RECIPES), default=list(RECIPES), help="default: all"
    )
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2], help="default: 0 1 2")
    parser.add_argument(
        "--steps", type=positive_int, default=None, help="RL steps (default: the recipe's max_steps)"
    )
    parser.add_argument("--work", type=Path, default=None, help="where to run (default: a new temp dir)")
    parser.add_argument("--quick", action="store_true", help="CI: seed 0 only")
    parser.add_argument(
        "--jobs",
        type=positive_int,
        default=1,
        help="recipes at the same time, each its seeds in turn (default: 1)",
    )
    args = parser.parse_args(argv)
    seeds = [0] if args.quick else args.seeds
    root = args.work or Path(tempfile.mkdtemp(prefix="recipe_learning_"))
    if root.exists() and not root.is_dir():
        parser.error(f"--work {root}: not a directory")
    if taken := [name for name in args.recipes if (root / name).exists()]:
        parser.error(f"--work {root}: already holds a run of {', '.join(taken)}; give a new directory")
    started = time.perf_counter()
    print(f"=== runs in {root}", flush=True)
    STOPPING.clear()

    def check_or_none(name: str) -> dict[int, Result | None]:
        try:
            return check(RECIPES[name], seeds, root, args.steps)
        except RuntimeError as error:  # the warm-up failed
            print(f"=== {name}: {error}", flush=True)
            return dict.fromkeys(seeds)

    pool = ThreadPoolExecutor(max_workers=args.jobs)
    try:
        results = dict(zip(args.recipes, pool.map(check_or_none, args.recipes), strict=True))
    except (KeyboardInterrupt, Interrupted):
        stop_running()
        pool.shutdown(wait=True, cancel_futures=True)
        print(f"=== recipe_learning interrupted; runs so far in {root}", flush=True)
        return 128 + signal.SIGINT
    pool.shutdown()
    print(f"\n{table(results, seeds)}\n\n=== {time.perf_counter() - started:.0f} s, runs in {root}")
    lost = [name for name, by_seed in results.items() if not all(passes(r) for r in by_seed.values())]
    if lost:
        print(f"=== recipe_learning FAILED: reward/mean or val/accuracy did not rise in {', '.join(lost)}")
        return 1
    print(f"=== recipe_learning passed: reward/mean and val/accuracy rose in {', '.join(results)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
