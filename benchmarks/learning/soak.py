"""Soak: thousands of RL steps, recording per step what a slow leak would grow (issue 37).

Two runs of ``lit-offpolicy fit``, each its own process, from the tiny model (random weights):

- sync: the demo's RL config (``configs/topr.yaml`` + ``configs/demo.yaml``), 2,000 steps;
- async: ``configs/async.yaml`` (``AsyncRollout``, a producer thread), 2,000 steps (1,000 read
  +1.16% ± 0.44%: too short to tell from the 1% goal).

Each keeps its config's callbacks (validation every 10 steps, a checkpoint every 10, the HF export)
with two changes: validation never stops the run early (``stop_at`` removed), and a ``ResourceProbe``
writes one JSON line per step with the process's resident set (``rss``, from /proc/self/statm), the
step's ``perf/peak_rss``, its open file descriptors, threads and child processes (all descendants),
and the size of the TensorBoard event files.

Figures, never a test: the slopes after warm-up (the first fifth of the steps) go to results.json.
RSS growth is given in % per 1,000 steps of the mean RSS after warm-up (the goal: under 1%);
descriptors, threads and children as their range after warm-up (the goal: constant); the event file
as bytes per step in the first and the second half after warm-up (constant: a log that does not
grow faster as the run goes on).

    python -m benchmarks.learning.soak             # about 100 min on 2 cores
    python -m benchmarks.learning.soak --quick     # 40 + 30 steps: the harness runs (figures meaningless)
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import lightning as L
import yaml

from benchmarks import REPO
from benchmarks.common import MiB, machine
from benchmarks.results import record

WARM_UP_FRACTION = 0.2
WINDOW = 100  # steps: the largest RSS of the first and of the last window after warm-up are recorded too
CONSTANT_SLACK = {"fds": 1, "threads": 0, "children": 0}
"""How far each count may range after warm-up and still count as constant: one descriptor comes and
goes with the step (a checkpoint or an event file being written when the probe reads)."""
RUNS = {  # name: (--config files, the config whose callbacks are kept, steps)
    "sync": (("configs/topr.yaml", "configs/demo.yaml"), "configs/demo.yaml", 2000),
    "async": (("configs/async.yaml",), "configs/async.yaml", 2000),
}


class ResourceProbe(L.Callback):
    """Appends one JSON line per training step to ``path``: what a leak would grow."""

    def __init__(self, path: str) -> None:
        self.path = Path(path)

    def on_train_batch_end(self, trainer: L.Trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        peak = trainer.callback_metrics.get("perf/peak_rss")
        row = {
            "step": trainer.global_step,
            "time": time.monotonic(),
            "rss": resident_bytes(),
            "peak_rss": float(peak) if peak is not None else None,
            "fds": len(os.listdir("/proc/self/fd")),
            "threads": thread_count(),
            "children": len(descendants(os.getpid())),
            "event_bytes": event_file_bytes(trainer),
        }
        with self.path.open("a") as file:
            file.write(json.dumps(row) + "\n")


def resident_bytes() -> int:
    """The process's resident set now (/proc/self/statm's second field, in pages)."""
    return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def thread_count() -> int:
    status = Path("/proc/self/status").read_text()
    return int(next(line for line in status.splitlines() if line.startswith("Threads:")).split()[1])


def descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (children, their children, ...), from /proc's parent ids."""
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:  # it ended while we looked
            continue
        parents[int(entry.name)] = int(stat.rsplit(")", 1)[1].split()[1])
    found, frontier = [], [pid]
    while frontier:
        parent = frontier.pop()
        children = [child for child, of in parents.items() if of == parent]
        found += children
        frontier += children
    return found


def event_file_bytes(trainer: L.Trainer) -> int:
    log_dir = getattr(trainer.logger, "log_dir", None)
    if log_dir is None:
        return 0
    return sum(path.stat().st_size for path in Path(log_dir).glob("events.out.tfevents.*"))


def soak_config(kept_from: str, probe_path: Path, steps: int) -> dict:
    """The override config: ``kept_from``'s callbacks without an early stop, plus the probe."""
    callbacks = yaml.safe_load((REPO / kept_from).read_text())["trainer"]["callbacks"]
    for callback in callbacks:
        validation = callback.get("init_args", {}).get("validation")
        if validation:
            validation.pop("stop_at", None)
            validation.pop("stop_after", None)
    probe = {"class_path": "benchmarks.learning.soak.ResourceProbe", "init_args": {"path": str(probe_path)}}
    return {"trainer": {"max_steps": steps, "enable_progress_bar": False, "callbacks": [*callbacks, probe]}}


def run(name: str, steps: int, work: Path, model: Path) -> list[dict]:
    """Train ``steps`` steps of run ``name`` in ``work``; the probe's rows."""
    configs, kept_from, _ = RUNS[name]
    work.mkdir(parents=True)
    probe_path = work / "probe.jsonl"
    override = work / "soak.yaml"
    override.write_text(yaml.safe_dump(soak_config(kept_from, probe_path, steps)))
    args = [arg for config in configs for arg in ("--config", str(REPO / config))]
    command = [sys.executable, "-m", "lit_offpolicy", "fit", *args, "--config", str(override)]
    command += ["--model.init_args.model_path", str(model)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    print(f"soak {name}: {steps} steps in {work}", flush=True)
    with (work / "fit.log").open("w") as log:
        subprocess.run(command, cwd=work, env=env, stdout=log, stderr=subprocess.STDOUT, check=True)
    return [json.loads(line) for line in probe_path.read_text().splitlines()]


def slope(xs: list[float], ys: list[float]) -> float:
    """The least-squares slope of ys against xs."""
    return fit_line(xs, ys)[0]


def fit_line(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """The least-squares slope of ys against xs and its standard error."""
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    if not sxx or n < 3:
        return 0.0, 0.0
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx
    residual = sum((y - my - b * (x - mx)) ** 2 for x, y in zip(xs, ys, strict=True))
    return b, (residual / (n - 2) / sxx) ** 0.5


def summarize(name: str, rows: list[dict], command: str) -> dict:
    """The run's slopes after warm-up, as a results.json entry."""
    settled = rows[math.ceil(len(rows) * WARM_UP_FRACTION) :]
    steps = [row["step"] for row in settled]
    rss = [row["rss"] for row in settled]
    mean_rss = sum(rss) / len(rss)
    rss_slope, rss_error = fit_line(steps, rss)
    rss_growth = 100 * rss_slope * 1000 / mean_rss
    windows = [settled[i : i + WINDOW] for i in range(0, len(settled), WINDOW)]
    half = len(settled) // 2
    first, second = settled[: half + 1], settled[half:]

    def bytes_per_step(part: list[dict]) -> float:
        return (part[-1]["event_bytes"] - part[0]["event_bytes"]) / max(part[-1]["step"] - part[0]["step"], 1)

    def spread(key: str) -> list[int]:
        return [min(row[key] for row in settled), max(row[key] for row in settled)]

    peaks = [row["peak_rss"] for row in settled if row["peak_rss"] is not None]
    constant = all(spread(key)[1] - spread(key)[0] <= CONSTANT_SLACK[key] for key in CONSTANT_SLACK)
    return {
        "name": f"soak_{name}",
        "unit": "% RSS per 1000 steps",
        "ours": round(rss_growth, 3),
        "baseline": None,
        "ratio": None,
        "repeats": 1,
        "machine": machine(),
        "goal": "RSS growth < 1% per 1,000 steps after warm-up; descriptors, threads and children constant",
        "goal_met": rss_growth < 1.0 and constant,
        "steps": rows[-1]["step"],
        "warm_up_steps": settled[0]["step"],
        "rss_growth_standard_error": round(100 * rss_error * 1000 / mean_rss, 3),
        "rss_mib_after_warm_up": round(mean_rss / MiB, 1),
        "rss_max_mib_first_and_last_window": [
            round(max(row["rss"] for row in window) / MiB, 1) for window in (windows[0], windows[-1])
        ],
        "peak_rss_growth_pct_per_1000_steps": (
            round(100 * slope(steps[-len(peaks) :], peaks) * 1000 / (sum(peaks) / len(peaks)), 3)
            if peaks
            else None
        ),
        "open_fds": spread("fds"),
        "threads": spread("threads"),
        "child_processes": spread("children"),
        "event_file_bytes_per_step": [round(bytes_per_step(first), 1), round(bytes_per_step(second), 1)],
        "seconds_per_step": round((settled[-1]["time"] - settled[0]["time"]) / max(len(settled) - 1, 1), 3),
        "command": command,
        "workload": f"{' + '.join(RUNS[name][0])}, tiny Llama (random weights), validation every 10 steps, "
        "a checkpoint every 10",
    }


def summarize_kept(directory: Path, command: str) -> list[dict]:
    """The entries of runs kept with ``--keep`` (their probe rows), e.g. after changing ``summarize``."""
    return [
        summarize(
            name,
            [json.loads(line) for line in (directory / name / "probe.jsonl").read_text().splitlines()],
            command,
        )
        for name in RUNS
        if (directory / name / "probe.jsonl").is_file()
    ]


def main(
    quick: bool = False,
    only: tuple[str, ...] = tuple(RUNS),
    keep: str | None = None,
    steps: int | None = None,
) -> list[dict]:
    """``steps``: each run's length instead of ``RUNS``' (a longer run narrows the slope's error)."""
    command = "python -m benchmarks.learning.soak" + (" --quick" if quick else "")
    command += f" --only {' '.join(only)}" if tuple(only) != tuple(RUNS) else ""
    command += f" --steps {steps}" if steps else ""
    entries = []
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(keep or tmp)
        model = work / "tiny"
        subprocess.run(
            [sys.executable, "-m", "lit_offpolicy", "create-tiny-model", str(model), "--seed", "0"],
            check=True,
            stdout=subprocess.DEVNULL,
        )
        for name in only:
            length = {"sync": 40, "async": 30}[name] if quick else steps or RUNS[name][2]
            rows = run(name, length, work / name, model)
            entries.append(summarize(name, rows, command))
            print(json.dumps(entries[-1]), flush=True)
    if quick:  # a smoke run: its figures are not recorded (``benchmarks.run`` records what is returned)
        return []
    record(entries)
    return entries


if __name__ == "__main__":
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--quick", action="store_true", help="40 + 30 steps: checks that it runs; records nothing"
    )
    parser.add_argument("--only", nargs="+", choices=list(RUNS), default=list(RUNS))
    parser.add_argument(
        "--keep", metavar="DIR", help="work in DIR (new) and keep the runs' logs and probe rows"
    )
    parser.add_argument("--steps", type=int, help="each run's steps (default: 2,000 each)")
    args = parser.parse_args()
    main(args.quick, tuple(args.only), args.keep, args.steps)
