"""Asynchronous (AsyncRollout, max_staleness 1 and 2) vs synchronous (Rollout) TOPR on the demo task.

From the demo's SFT warm-up, each mode runs ``configs/topr.yaml`` (128 prompts × 4 samples per step,
HF engine, val/accuracy on 256 held-out problems every 10 steps) in its own process, one after the
other in one invocation, until val/accuracy reaches ``--target`` or ``--max-steps``. From the
TensorBoard logs, with t0 = the evaluation before the first step:

- samples/s: trained samples / (wall time of the last step − t0), evaluations included (same for all);
- seconds to target: wall time of the first evaluation with val/accuracy ≥ target − t0.

    python -m benchmarks.learning.async_vs_sync [--max-steps 500] [--sft-dir outputs/sft-tiny] [--threads 1]

Threads: the synchronous run uses every core (``--sync-threads``, its best setting); the async runs
use one torch thread each (``--threads``), since producer and trainer are two threads of one
process and two OpenMP teams on two cores spin against each other.
    python -m benchmarks.learning.async_vs_sync --max-steps 3 --no-record      # smoke test, about a minute

``--rollout-correction seq_is_rs`` (any preset) trains every mode with that correction, as
``configs/async.yaml`` does; ``--modes`` picks modes and ``--jobs`` runs them side by side (on a
machine with cores to spare: concurrent runs on two cores slow each other down). The modes
``async_k1_partial`` and ``async_k2_partial`` add ``partial_rollouts: true`` (not run by default).

Entries (benchmarks/results.json, ratio > 1 means async is better): ``async_k{1,2}_samples_per_s``
(ratio = async / sync) and ``async_k{1,2}_seconds_to_0.9`` (ratio = sync / async).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import lightning as L
import torch
import yaml
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from benchmarks import REPO
from benchmarks.results import record_or_print
from lit_offpolicy.core.tensorboard import latest_run

MODES = {"sync": None, "async_k1": 1, "async_k2": 2, "async_k1_partial": 1, "async_k2_partial": 2}
"""Each mode's max_staleness (None: the synchronous Rollout); ``_partial``: with partial rollouts."""
DEFAULT_MODES = ["sync", "async_k1", "async_k2"]


class StopAtAccuracy(L.Callback):
    """Stops training once the rollout callback's last evaluation reached ``target`` val/accuracy."""

    def __init__(self, target: float = 0.9) -> None:
        self.target = target

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        accuracy = trainer.callback_metrics.get("val/accuracy")
        if accuracy is not None and float(accuracy) >= self.target:
            trainer.should_stop = True


def lit_offpolicy(*args: str, threads: int) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    subprocess.run([sys.executable, "-m", "lit_offpolicy", *args], cwd=REPO, env=env, check=True)


def warm_up(work: Path, threads: int) -> Path:
    """The demo's first two stages: the tiny model, then SFT until val/accuracy 0.4."""
    initial, sft = work / "tiny-init", work / "sft-tiny"
    lit_offpolicy("create-tiny-model", str(initial), threads=threads)
    logger = {
        "class_path": "lightning.pytorch.loggers.TensorBoardLogger",
        "init_args": {"save_dir": str(work)},
    }
    config = yaml.safe_load((REPO / "configs" / "sft_tiny.yaml").read_text())
    callbacks = config["trainer"]["callbacks"]
    callbacks[-1]["init_args"]["dirpath"] = str(sft)  # HFExport
    lit_offpolicy(
        "fit",
        "--config",
        "configs/sft_tiny.yaml",
        "--model.init_args.model_path",
        str(initial),
        "--trainer.logger",
        json.dumps(logger),
        "--trainer.callbacks",
        json.dumps(callbacks),
        "--trainer.enable_progress_bar",
        "false",
        threads=threads,
    )
    return sft


def rollout_callback(max_staleness: int | None, partial_rollouts: bool = False) -> dict:
    """The demo's Rollout callback (configs/base/trainer.yaml), or AsyncRollout with the same settings
    (and ``partial_rollouts``)."""
    base = yaml.safe_load((REPO / "configs" / "base" / "trainer.yaml").read_text())
    (rollout,) = [c for c in base["callbacks"] if c["class_path"].endswith(".Rollout")]
    if max_staleness is None:
        return rollout
    init_args = {**rollout["init_args"], "max_staleness": max_staleness}
    if partial_rollouts:
        init_args["partial_rollouts"] = True
    return {"class_path": "lit_offpolicy.callbacks.AsyncRollout", "init_args": init_args}


def train(
    mode: str, sft: Path, work: Path, max_steps: int, target: float, threads: int, correction: str
) -> Path:
    stop = {"class_path": "benchmarks.learning.async_vs_sync.StopAtAccuracy", "init_args": {"target": target}}
    callbacks = [rollout_callback(MODES[mode], mode.endswith("_partial")), stop]
    fit_topr(
        sft, work, mode, callbacks, max_steps, threads, "--model.init_args.rollout_correction", correction
    )
    return latest_run(work / "logs" / mode)


def fit_topr(
    sft: Path, work: Path, name: str, callbacks: list[dict], steps: int, threads: int, *args: str
) -> None:
    """``lit-offpolicy fit`` of configs/topr.yaml from ``sft`` for ``steps`` RL steps with these trainer
    ``callbacks`` (and ``args``), logged to TensorBoard in ``work``/logs/``name``; no checkpoints, no bar."""
    logger = {
        "class_path": "lightning.pytorch.loggers.TensorBoardLogger",
        "init_args": {"save_dir": str(work / "logs"), "name": name},
    }
    lit_offpolicy(
        "fit",
        "--config",
        "configs/topr.yaml",
        "--model.init_args.model_path",
        str(sft),
        "--trainer.max_steps",
        str(steps),
        "--trainer.callbacks",
        json.dumps(callbacks),
        "--trainer.logger",
        json.dumps(logger),
        "--trainer.enable_checkpointing",
        "false",
        "--trainer.enable_progress_bar",
        "false",
        *args,
        threads=threads,
    )


def scalar_events(run: Path, tag: str) -> list[tuple[float, int, float]]:
    """(wall time, step, value) of every ``tag`` event in ``run``."""
    events = EventAccumulator(str(run), size_guidance={"scalars": 0})
    events.Reload()
    return [(e.wall_time, e.step, e.value) for e in events.Scalars(tag)]


def measure(run: Path, target: float, samples_per_step: int) -> dict:
    accuracy = scalar_events(run, "val/accuracy")
    versions = scalar_events(run, "actor/policy_version")
    t0 = accuracy[0][0]
    steps = int(versions[-1][2])
    reached = [(wall, step, value) for wall, step, value in accuracy if value >= target]
    return {
        "steps": steps,
        "samples_per_s": round(steps * samples_per_step / (versions[-1][0] - t0), 1),
        "seconds_to_target": round(reached[0][0] - t0, 1) if reached else None,
        "steps_to_target": reached[0][1] if reached else None,
        "final_accuracy": accuracy[-1][2],
    }


def machine(threads: int, sync_threads: int) -> str:
    cpus = f"{platform.machine()} {os.cpu_count()} CPUs"
    return f"{cpus}, torch {torch.__version__} (async runs {threads} thread(s), sync run {sync_threads})"


def entries(
    results: dict[str, dict],
    target: float,
    max_steps: int,
    threads: int,
    sync_threads: int,
    correction: str,
) -> list[dict]:
    sync = results["sync"]
    suffix = "" if correction == "disabled" else f"_{correction}"
    common = {
        "repeats": 1,
        "machine": machine(threads, sync_threads),
        "workload": f"demo TOPR from the SFT warm-up, 128 prompts x 4 samples per step, HF engine, "
        f"rollout correction {correction}, until val/accuracy >= {target} or {max_steps} steps",
    }
    out = []
    for mode in [m for m in MODES if m != "sync" and m in results]:
        ours = results[mode]
        out.append(
            {
                "name": f"{mode}{suffix}_samples_per_s",
                "unit": "samples/s",
                "ours": ours["samples_per_s"],
                "baseline": sync["samples_per_s"],
                "ratio": round(ours["samples_per_s"] / sync["samples_per_s"], 3),
                **common,
            }
        )
        seconds, baseline = ours["seconds_to_target"], sync["seconds_to_target"]
        out.append(
            {
                "name": f"{mode}{suffix}_seconds_to_{target}",
                "unit": "s",
                "ours": seconds,
                "baseline": baseline,
                "ratio": round(baseline / seconds, 3) if seconds and baseline else None,
                "steps": {"ours": ours["steps_to_target"], "baseline": sync["steps_to_target"]},
                **common,
            }
        )
    return out


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--max-steps", type=int, default=500, help="RL step cap per mode")
    parser.add_argument("--target", type=float, default=0.9, help="val/accuracy to reach")
    parser.add_argument(
        "--sft-dir", type=Path, default=None, help="an SFT warm-up to reuse (default: train one)"
    )
    parser.add_argument("--work-dir", type=Path, default=REPO / "outputs" / "bench_async")
    parser.add_argument(
        "--threads", type=int, default=1, help="OMP_NUM_THREADS of the async runs (producer + trainer)"
    )
    parser.add_argument(
        "--sync-threads",
        type=int,
        default=os.cpu_count(),
        help="OMP_NUM_THREADS of the synchronous run: every core, its best setting (default)",
    )
    parser.add_argument(
        "--rollout-correction",
        default="disabled",
        help="a rollout-correction preset for every mode, e.g. seq_is_rs (default: disabled)",
    )
    parser.add_argument("--modes", nargs="+", choices=list(MODES), default=DEFAULT_MODES)
    parser.add_argument("--jobs", type=int, default=1, help="modes trained at the same time")
    parser.add_argument(
        "--no-record", action="store_true", help="print the entries, leave results.json alone"
    )
    args = parser.parse_args(argv)

    work = args.work_dir / time.strftime("%Y%m%d-%H%M%S")
    sft = args.sft_dir or warm_up(work, args.threads)
    prompts = yaml.safe_load((REPO / "configs" / "base" / "data.yaml").read_text())["batch_size"]
    samples_per_step = prompts * rollout_callback(None)["init_args"]["sampling"]["n"]

    def run(mode: str) -> dict:
        threads = args.sync_threads if mode == "sync" else args.threads
        log = train(mode, sft, work, args.max_steps, args.target, threads, args.rollout_correction)
        result = measure(log, args.target, samples_per_step)
        print(f"=== {mode}: {json.dumps(result)}", flush=True)
        return result

    with ThreadPoolExecutor(max_workers=args.jobs) as pool:
        results = dict(zip(args.modes, pool.map(run, args.modes), strict=True))
    if "sync" not in results:
        return []  # the ratios need the synchronous run; the printed lines are the result
    out = entries(
        results, args.target, args.max_steps, args.threads, args.sync_threads, args.rollout_correction
    )
    record_or_print(out, args.no_record)
    return out


if __name__ == "__main__":
    main()
