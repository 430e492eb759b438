"""``compile: true`` against eager: seconds per training step, and what compiling costs, on this machine.

Two workloads, each run twice in one process (eager, then compiled) through ``Trainer.fit`` of
OffPolicyModule with GRPO + PPO clip, π_old recomputed (two mini-batches a step):
- ``tiny``: the tiny Llama on ``common.fixed_experience`` batches of 128 prompts × 4 samples;
- ``qwen3-180m``: the Qwen3-shaped model of the memory benchmark (random weights), 16 samples with
  prompts of 32..64 and responses of 16..128 tokens, micro-batches of 8.
Each step gets a batch whose response width differs from the step before (as rollouts do), so the
compiled side also pays its recompilation for dynamic shapes. The first ``WARMUP_STEPS`` steps of
each side are dropped from the median and reported apart (``first_steps_s``: compilation included).

    python -m benchmarks.compile_step [--steps 8] [--workloads tiny qwen3-180m]
"""

from __future__ import annotations

import argparse
import tempfile
from types import SimpleNamespace

import lightning as L
import torch

from benchmarks.common import (
    StepTimer,
    dummy_batches,
    entry,
    fixed_experience,
    fresh,
    median,
    quiet_trainer,
)
from benchmarks.results import record
from lit_offpolicy import OffPolicyModule
from lit_offpolicy.advantages import GRPO
from lit_offpolicy.core.experience import Experience
from lit_offpolicy.losses import PPO
from lit_offpolicy.models import create_tiny_model, load_tokenizer
from lit_offpolicy.training.options import OptimOptions, UpdateOptions

WARMUP_STEPS = 3
TINY_WIDTHS = (16, 12, 14, 10)  # response widths, cycled step by step
QWEN_WIDTHS = (128, 96, 112, 80)


class FeedCycle(L.Callback):
    """Puts ``experiences[step % len]`` (a fresh copy of its rollout fields) into each training batch."""

    def __init__(self, experiences: list[Experience]) -> None:
        self.experiences = experiences

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        experience = self.experiences[batch_idx % len(self.experiences)]
        batch["experience"] = fresh(experience, pl_module.policy_version)


def tiny_batches(model_dir: str) -> list[Experience]:
    tokenizer = load_tokenizer(model_dir)
    return [fixed_experience(tokenizer, response_length=width, seed=i) for i, width in enumerate(TINY_WIDTHS)]


def qwen_batches(model_dir: str) -> list[Experience]:
    from benchmarks.memory_vs_trl import SHAPES
    from benchmarks.update_throughput_vs_trl import fixed_batch

    vocab = SHAPES["qwen3-180m"]["vocab_size"]
    batches = []
    for i, width in enumerate(QWEN_WIDTHS):
        shape = SimpleNamespace(prompts=2, prompt_length=64, min_response=16, max_response=width)
        data = fixed_batch(shape, vocab, seed=i)
        data.pop("advantages")
        batches.append(Experience(**data, policy_versions=torch.zeros(len(data["scores"]), dtype=torch.long)))
    return batches


def step_seconds(model_dir: str, batches: list[Experience], compile: bool, steps: int, micro: int | None):
    L.seed_everything(0, verbose=False)
    module = OffPolicyModule(
        model_dir,
        policy_loss=PPO(pg_clip=0.2, loss_agg_mode="token-mean"),
        advantage=GRPO(norm_by_std=True),
        optim=OptimOptions(lr=1e-5),
        update=UpdateOptions(mini_batch_size=len(batches[0]) // 2, micro_batch_size=micro),
        compile=compile,
    )
    timer = StepTimer()
    with tempfile.TemporaryDirectory() as root:
        # two optimizer steps per RL step: max_steps counts optimizer steps
        trainer = quiet_trainer(2 * steps, [FeedCycle(batches), timer], root)
        trainer.fit(module, train_dataloaders=dummy_batches(steps))
    return timer.seconds


def measure(name: str, model_dir: str, batches: list[Experience], steps: int, micro: int | None) -> dict:
    sides = {}
    for compile in (False, True):
        print(f"[compile_step] {name}: compile={compile}, {steps} steps", flush=True)
        sides[compile] = step_seconds(model_dir, batches, compile, steps, micro)
    eager, compiled = (sides[flag][WARMUP_STEPS:] for flag in (False, True))
    tokens = sum(int(b.response_mask.sum()) for b in batches) / len(batches)
    return entry(
        f"compile_step_{name}",
        "s",
        median(compiled),
        median(eager),
        len(compiled),
        baseline_is="the same steps eager (compile=False)",
        first_steps_s={
            "eager": [round(s, 2) for s in sides[False][:WARMUP_STEPS]],
            "compiled": [round(s, 2) for s in sides[True][:WARMUP_STEPS]],
        },
        workload=(
            f"{name}: GRPO + PPO clip, {len(batches[0])} samples a step ({tokens:.0f} response tokens), "
            f"two mini-batches, micro-batches of {micro or 'the mini-batch'}, {len(batches)} response widths"
        ),
        what="seconds per RL step after the first steps (median); compiled: the blocks, inductor",
    )


def main(steps: int = 8, workloads: tuple[str, ...] = ("tiny", "qwen3-180m")) -> list[dict]:
    entries = []
    with tempfile.TemporaryDirectory() as tmp:
        if "tiny" in workloads:
            model_dir = str(create_tiny_model(f"{tmp}/tiny"))
            entries.append(measure("tiny", model_dir, tiny_batches(model_dir), steps, None))
        if "qwen3-180m" in workloads:
            from benchmarks.memory_vs_trl import build_model

            build_model(f"{tmp}/qwen", "qwen3-180m")
            entries.append(measure("qwen3_180m", f"{tmp}/qwen", qwen_batches(f"{tmp}/qwen"), steps, 8))
    return entries


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--workloads", nargs="+", default=["tiny", "qwen3-180m"])
    args = parser.parse_args()
    record(main(args.steps, tuple(args.workloads)))
