"""TRL's side of ``benchmarks.peers.end_to_end_trl``: GRPOTrainer, the same settings. Runs in ``.venv-bench``.

The same model directory, tokenizer, task, reward, batch (``per_device_train_batch_size`` counts
completions in TRL: prompts × samples), group size, lengths, learning rate and seed. TRL's defaults
that would make its step do other work than ours are turned off: bf16 (the CPU run is float32),
gradient checkpointing, KL (``beta`` 0 is already TRL's default), learning-rate decay and
reporting. ``loss_type="dapo"`` is the token-mean aggregation ours uses; ``scale_rewards="group"`` is
GRPO's std normalization.

    .venv-bench/bin/python -m benchmarks.peers.trl_grpo --model DIR --steps 30 --out trl.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import trl
from datasets import Dataset
from trl import GRPOTrainer

from benchmarks.peers.end_to_end_trl import SETTINGS, validation_accuracy
from benchmarks.peers.trl_side import StepTimer, grpo_config
from benchmarks.step_profile import Regions, install_trl
from lit_offpolicy.data.tasks import get_task
from lit_offpolicy.models import load_actor, load_tokenizer
from lit_offpolicy.rewards import REWARDS


def exact_answer(completions: list[str], answer: list[str], **kwargs) -> list[float]:
    """Our exact-answer reward, in TRL's reward-function signature."""
    return REWARDS.resolve("exact")(completions, answer).scores


def train(model_dir: str, steps: int, output_dir: str) -> dict:
    s = SETTINGS
    problems = get_task("addition").train(s["prompts_per_step"] * steps, seed=s["seed"])
    config = grpo_config(
        output_dir=output_dir,
        use_cpu=True,
        bf16=False,
        gradient_checkpointing=False,
        per_device_train_batch_size=s["prompts_per_step"] * s["samples_per_prompt"],
        num_generations=s["samples_per_prompt"],
        max_completion_length=s["max_response_length"],
        temperature=s["temperature"],
        learning_rate=s["lr"],
        max_grad_norm=s["max_grad_norm"],
        epsilon=s["clip"],
        scale_rewards="group",
        max_steps=steps,
        seed=s["seed"],
        logging_steps=10,
    )
    tokenizer = load_tokenizer(model_dir)
    regions = Regions()
    install_trl(regions)
    timer = StepTimer(regions)
    trainer = GRPOTrainer(
        model=load_actor(model_dir),
        reward_funcs=exact_answer,
        args=config,
        train_dataset=Dataset.from_list(problems),
        processing_class=tokenizer,
        callbacks=[timer],
    )
    trainer.train()
    model = trainer.model
    return {
        "step_seconds": timer.seconds,
        "val_accuracy": validation_accuracy(model, tokenizer),
        "trl_version": trl.__version__,
        "profile": regions.medians(),
    }


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    args.out.write_text(json.dumps(train(args.model, args.steps, str(args.out.parent / "trl-output"))))
