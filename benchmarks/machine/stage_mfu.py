"""How close each stage of a GRPO step is to this machine's limit, at the Qwen3 shape (issue 35, item 3).

One ``lit-offpolicy fit`` of ``configs/grpo.yaml`` + ``configs/rollout/vllm.yaml`` (in-process vLLM on
the CPU) from the Qwen3-shaped model of the memory benchmark (``shapes.SHAPES["qwen3-180m"]``:
151,936-token vocabulary, 181M parameters, float32, random weights), on the addition task:
``--prompts`` prompts × 8 samples a step, responses of ``--max-tokens`` (random weights rarely stop),
the update padding-free with micro-batches of at most 4,096 tokens, the KL loss's reference pass on.
No validation, checkpoints or export: only the steps.

Read back from TensorBoard, the median over the steps after the first of each stage's
``perf/mfu/<stage>`` (model FLOPs per second over the peak that ``lit_offpolicy.core.flops`` measured
for float32 on this CPU) and ``perf/tokens_per_s/<stage>``, and the stage's share of the step
(``timing/*``). The entry names the stage furthest from its limit (the lowest MFU). Figures, never a
test.

    python -m benchmarks.machine.stage_mfu [--steps 4] [--prompts 4] [--max-tokens 64]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

from benchmarks import REPO
from benchmarks.common import machine, median
from benchmarks.results import record_or_print
from lit_offpolicy.core.tensorboard import read_scalars

STAGES = ("generate", "frozen", "update")
SAMPLES_PER_PROMPT = 8


def vllm_rollout(samples: int, max_tokens: int) -> dict:
    """configs/rollout/vllm.yaml's Rollout callback alone: ``samples`` of ``max_tokens`` per prompt, no
    validation."""
    config = yaml.safe_load((REPO / "configs" / "rollout" / "vllm.yaml").read_text())
    (rollout,) = [c for c in config["trainer"]["callbacks"] if c["class_path"].endswith(".Rollout")]
    rollout["init_args"]["sampling"].update(n=samples, max_tokens=max_tokens)
    rollout["init_args"]["validation"] = {"every_n_steps": 0}
    return rollout


def fit(model_dir: Path, logs: Path, steps: int, prompts: int, max_tokens: int) -> None:
    logger = {
        "class_path": "lightning.pytorch.loggers.TensorBoardLogger",
        "init_args": {"save_dir": str(logs)},
    }
    command = [sys.executable, "-m", "lit_offpolicy", "fit", "--config", "configs/grpo.yaml"]
    command += ["--model.init_args.model_path", str(model_dir), "--trainer.max_steps", str(steps)]
    command += ["--trainer.callbacks", json.dumps([vllm_rollout(SAMPLES_PER_PROMPT, max_tokens)])]
    command += ["--trainer.logger", json.dumps(logger), "--trainer.enable_checkpointing", "false"]
    command += ["--model.init_args.padding_free", "true"]
    command += ["--model.init_args.update.max_tokens_per_micro_batch", "4096"]
    command += ["--data.batch_size", str(prompts), "--data.num_val_samples", "8"]
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1"}
    subprocess.run(command, check=True, cwd=REPO, env=env)


def stage_figures(run: Path) -> dict[str, dict[str, float]]:
    """Per stage, the median after the first step of its MFU, tokens/s and seconds."""
    figures = {}
    for stage in STAGES:
        values = {
            name: [value for _, value in read_scalars(run, tag)[1:]]
            for name, tag in (
                ("mfu", f"perf/mfu/{stage}"),
                ("tokens_per_s", f"perf/tokens_per_s/{stage}"),
                ("seconds", f"timing/{stage}"),
            )
        }
        figures[stage] = {name: round(median(v), 4) for name, v in values.items() if v}
    return figures


def main(steps: int = 4, prompts: int = 4, max_tokens: int = 64) -> list[dict]:
    from benchmarks.shapes import build_model

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(tmp) / "qwen3-180m"
        build_model(str(model_dir), "qwen3-180m")
        fit(model_dir, Path(tmp) / "logs", steps, prompts, max_tokens)
        (run,) = (Path(tmp) / "logs").glob("*/version_0")  # the config's logger name (rl)
        figures = stage_figures(run)
    measured = {stage: f for stage, f in figures.items() if "mfu" in f}
    furthest = min(measured, key=lambda stage: measured[stage]["mfu"])
    return [
        {
            "name": "stage_mfu_qwen_shaped",
            "unit": "MFU",
            "ours": measured[furthest]["mfu"],
            "baseline": None,
            "ratio": None,
            "repeats": steps - 1,
            "machine": machine(),
            "furthest_from_limit": furthest,
            "stages": figures,
            "what": "median per stage over the steps after the first: perf/mfu/<stage> (model FLOPs/s over "
            "the measured float32 peak), perf/tokens_per_s/<stage>, timing/<stage> seconds; 'ours' is the "
            "lowest MFU, of the stage furthest from its limit",
            "workload": "configs/grpo.yaml + configs/rollout/vllm.yaml, qwen3-180m (float32, random "
            f"weights), {prompts} prompts x {SAMPLES_PER_PROMPT} samples x {max_tokens} tokens, padding-free,"
            f" micro-batches of <= 4,096 tokens, KL loss with the reference",
            "command": f"python -m benchmarks.machine.stage_mfu --steps {steps} --prompts {prompts} "
            f"--max-tokens {max_tokens}",
        }
    ]


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--no-record", action="store_true", help="print the entry, leave results.json")
    args = parser.parse_args()
    entries = main(args.steps, args.prompts, args.max_tokens)
    record_or_print(entries, args.no_record, indent=1)
