"""GPU check of the scale-out strategies: the demo's TOPR run under DDP, FSDP2 and DeepSpeed ZeRO-2.

Needs a CUDA machine (and ``deepspeed`` for ZeRO-2). Each strategy runs the same command a user
would, in its own process, from the same SFT warm-up::

    lit-offpolicy fit --config configs/topr.yaml --trainer configs/strategy/STRATEGY.yaml \
        --trainer.max_steps STEPS --trainer.devices 1

and the script prints, per strategy, the wall time, the median seconds per RL step (``timing/update``
+ ``timing/prepare`` + ``timing/generate`` as logged), each stage's median ``perf/mfu`` and
``perf/tokens_per_s``, and ``val/accuracy`` before and after.

    python -m benchmarks.machine.strategies_gpu [--steps 40] [--strategies ddp fsdp deepspeed_zero2]
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from pathlib import Path

from benchmarks.common import median, timed
from lit_offpolicy.core.tensorboard import latest_run, read_scalars

OUTPUTS = Path("outputs")  # the configs' own paths: outputs/tiny-init, outputs/sft-tiny, outputs/logs/rl


def run(*args: str) -> float:
    print(f"\n=== lit-offpolicy {' '.join(args)}", flush=True)
    return timed(lambda: subprocess.run([sys.executable, "-m", "lit_offpolicy", *args], check=True))[0]


def warm_up() -> None:
    """The demo's tiny model and SFT warm-up (on the GPU), once for all strategies."""
    run("create-tiny-model", str(OUTPUTS / "tiny-init"), "--overwrite")
    run("fit", "--config=configs/sft_tiny.yaml", "--trainer.accelerator=gpu")


def rl(strategy: str, steps: int) -> dict:
    shutil.rmtree(OUTPUTS / "checkpoints", ignore_errors=True)  # FSDP2 writes a directory, ZeRO a file
    seconds = run(
        "fit",
        "--config=configs/topr.yaml",
        f"--trainer=configs/strategy/{strategy}.yaml",
        "--trainer.devices=1",
        f"--trainer.max_steps={steps}",
    )
    logs = latest_run(OUTPUTS / "logs" / "rl")
    stages = [read_scalars(logs, f"timing/{name}") for name in ("generate", "prepare", "update")]
    per_step = [sum(values) for values in zip(*[[v for _, v in s] for s in stages], strict=True)]
    accuracy = [value for _, value in read_scalars(logs, "val/accuracy")]
    return {
        "strategy": strategy,
        "rl_steps": steps,
        "wall_seconds": round(seconds, 1),
        "median_step_seconds": round(median(per_step[1:]), 4),
        **{  # median of each stage's model FLOPs / s over the device's peak, and its tokens/s
            f"{metric}_{stage}": round(median(v for _, v in values[1:]), 4)
            for metric in ("mfu", "tokens_per_s")
            for stage in ("generate", "frozen", "update")
            if (values := read_scalars(logs, f"perf/{metric}/{stage}"))
        },
        "val_accuracy_first": accuracy[0],
        "val_accuracy_last": accuracy[-1],
        "exported": (OUTPUTS / "actor" / "config.json").is_file(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--strategies", nargs="+", default=["ddp", "fsdp", "deepspeed_zero2"])
    args = parser.parse_args()
    warm_up()
    results = [rl(strategy, args.steps) for strategy in args.strategies]
    print("\n=== strategies")
    for result in results:
        print(json.dumps(result))


if __name__ == "__main__":
    main()
