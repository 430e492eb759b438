"""``compile: true`` against eager: seconds per training step, and what compiling costs, on this machine.

Two workloads, each run twice in one process (eager, then compiled) through ``Trainer.fit`` of
OffPolicyModule with GRPO + PPO clip, π_old recomputed (two mini-batches a step):
- ``tiny``: the tiny Llama on ``common.fixed_experience`` batches of 128 prompts × 4 samples;
- ``qwen3-180m``: the Qwen3-shaped model of the memory benchmark (random weights), 16 samples with
  prompts of 32..64 and responses of 16..128 tokens, micro-batches of 8;
- ``qwen2.5-1.5b`` (``--device cuda``): Qwen2.5-1.5B's shape in bfloat16 (random weights), 64 samples
  (8 prompts × 8) with prompts of 32..64 and responses of 64..256 tokens, micro-batches of 16.
Each step gets a batch whose response width differs from the step before (as rollouts do), so the
compiled side also pays its recompilation for dynamic shapes. The first ``WARMUP_STEPS`` steps of
each side are dropped from the median and reported apart (``first_steps_s``: compilation included).
Each side's update MFU (``perf/mfu/update`` as the module logs it: model FLOPs over the device's peak,
``lit_offpolicy.core.flops``) is reported beside its seconds.

    python -m benchmarks.pytorch.compile_step [--steps 8] [--workloads tiny qwen3-180m]
    python -m benchmarks.pytorch.compile_step --device cuda     # qwen2.5-1.5b, bf16, one GPU
"""

from __future__ import annotations

import argparse
import tempfile
from dataclasses import dataclass
from types import SimpleNamespace

import lightning as L

from benchmarks.common import (
    StepTimer,
    as_experience,
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
GPU_WIDTHS = (256, 192, 224, 160)


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


class UpdateMFU(L.Callback):
    """The ``perf/mfu/update`` the module logged at each training step."""

    def __init__(self) -> None:
        self.values: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.values.append(float(trainer.callback_metrics["perf/mfu/update"]))


def qwen_batches(
    shape_name: str, widths: tuple[int, ...], prompts: int, min_response: int
) -> list[Experience]:
    from benchmarks.peers.update_throughput_vs_trl import fixed_batch
    from benchmarks.shapes import SHAPES

    vocab = SHAPES[shape_name]["vocab_size"]
    batches = []
    for i, width in enumerate(widths):
        shape = SimpleNamespace(
            prompts=prompts, prompt_length=64, min_response=min_response, max_response=width
        )
        batches.append(as_experience(fixed_batch(shape, vocab, seed=i)))
    return batches


@dataclass(frozen=True)
class Workload:
    name: str
    model_dir: str
    batches: list[Experience]
    micro: int | None
    device: str = "cpu"
    dtype: str = "float32"


def step_seconds(work: Workload, compile: bool, steps: int) -> tuple[list[float], list[float]]:
    """(seconds, update MFU) of each of ``steps`` RL steps."""
    L.seed_everything(0, verbose=False)
    module = OffPolicyModule(
        work.model_dir,
        policy_loss=PPO(pg_clip=0.2, loss_agg_mode="token-mean"),
        advantage=GRPO(norm_by_std=True),
        optim=OptimOptions(lr=1e-5),
        update=UpdateOptions(mini_batch_size=len(work.batches[0]) // 2, micro_batch_size=work.micro),
        compile=compile,
        dtype=work.dtype,
    )
    timer, mfu = StepTimer(), UpdateMFU()
    with tempfile.TemporaryDirectory() as root:
        # two optimizer steps per RL step: max_steps counts optimizer steps
        trainer = quiet_trainer(2 * steps, [FeedCycle(work.batches), mfu, timer], root, work.device)
        trainer.fit(module, train_dataloaders=dummy_batches(steps))
    return timer.seconds, mfu.values


def measure(work: Workload, steps: int) -> dict:
    sides, mfu = {}, {}
    for compile in (False, True):
        print(f"[compile_step] {work.name}: compile={compile}, {steps} steps on {work.device}", flush=True)
        sides[compile], mfu[compile] = step_seconds(work, compile, steps)
    eager, compiled = (sides[flag][WARMUP_STEPS:] for flag in (False, True))
    batches, micro = work.batches, work.micro
    tokens = sum(int(b.response_mask.sum()) for b in batches) / len(batches)
    return entry(
        f"compile_step_{work.name}",
        "s",
        median(compiled),
        median(eager),
        len(compiled),
        baseline_is="the same steps eager (compile=False)",
        first_steps_s={
            "eager": [round(s, 2) for s in sides[False][:WARMUP_STEPS]],
            "compiled": [round(s, 2) for s in sides[True][:WARMUP_STEPS]],
        },
        mfu_update={
            "eager": round(median(mfu[False][WARMUP_STEPS:]), 4),
            "compiled": round(median(mfu[True][WARMUP_STEPS:]), 4),
        },
        workload=(
            f"{work.name} ({work.dtype}): GRPO + PPO clip, {len(batches[0])} samples a step ({tokens:.0f} "
            f"response tokens), two mini-batches, micro-batches of {micro or 'the mini-batch'}, "
            f"{len(batches)} response widths"
        ),
        what="seconds per RL step after the first steps (median); compiled: the blocks, inductor",
    )


def main(steps: int = 8, workloads: tuple[str, ...] = ("tiny", "qwen3-180m")) -> list[dict]:
    from benchmarks.shapes import build_model

    entries = []
    with tempfile.TemporaryDirectory() as tmp:
        if "tiny" in workloads:
            model_dir = str(create_tiny_model(f"{tmp}/tiny"))
            entries.append(measure(Workload("tiny", model_dir, tiny_batches(model_dir), None), steps))
        if "qwen3-180m" in workloads:
            build_model(f"{tmp}/qwen", "qwen3-180m")
            batches = qwen_batches("qwen3-180m", QWEN_WIDTHS, prompts=2, min_response=16)
            entries.append(measure(Workload("qwen3_180m", f"{tmp}/qwen", batches, 8), steps))
        if "qwen2.5-1.5b" in workloads:
            build_model(f"{tmp}/qwen25", "qwen2.5-1.5b")
            batches = qwen_batches("qwen2.5-1.5b", GPU_WIDTHS, prompts=8, min_response=64)
            work = Workload("qwen25_1p5b_cuda", f"{tmp}/qwen25", batches, 16, "cuda", "bfloat16")
            entries.append(measure(work, steps))
    return entries


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--workloads", nargs="+", help="default: tiny qwen3-180m (cpu), qwen2.5-1.5b (cuda)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    args = parser.parse_args()
    default = ["qwen2.5-1.5b"] if args.device == "cuda" else ["tiny", "qwen3-180m"]
    record(main(args.steps, tuple(args.workloads or default)))
