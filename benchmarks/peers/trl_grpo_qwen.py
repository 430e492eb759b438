"""TRL's side of ``benchmarks.peers.end_to_end_qwen``: GRPOTrainer, the Qwen3 shape. Runs in ``.venv-bench``.

The same model directory, prompts file, group size, lengths, temperature, reward
(``end_to_end_qwen.length_hash_reward``), learning rate and seed as ours. Float32 (``bf16`` off),
no gradient checkpointing, KL off (``beta`` 0, TRL's default), a constant learning rate, no
reporting; ``per_device_train_batch_size`` (completions) of at most ``MICRO`` with gradient
accumulation over the generation batch, so one optimizer step per batch of prompts × samples, as
``update_throughput_vs_trl`` runs TRL at this shape. ``loss_type="dapo"`` is ours' token-mean,
``scale_rewards="group"`` GRPO's std normalization. Generation is HF ``generate`` (TRL's vLLM
colocate mode does not run on this CPU: ``end_to_end_qwen.TRL_TRIED``). Its stages are timed by
``benchmarks.step_profile``; tokens/s are prompt + response tokens (the lengths the reward saw) over
a stage's seconds.

    .venv-bench/bin/python -m benchmarks.peers.trl_grpo_qwen --model DIR --prompts-file F --steps 4 \\
        --work '{"prompts": 8, "samples": 8, "max_tokens": 256}' --out trl.json
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch
import trl
from datasets import Dataset
from trl import GRPOConfig, GRPOTrainer

from benchmarks.common import medians
from benchmarks.peers.end_to_end_qwen import LENGTHS_ENV, LR, PROMPT_TOKENS, length_hash_reward
from benchmarks.peers.trl_side import StepTimer, grpo_config
from benchmarks.step_profile import Regions, install_trl
from lit_offpolicy.models import load_actor, load_tokenizer

MICRO = 8
UPDATE_REGIONS = ("forward", "backward", "loss terms and their metrics", "grad-norm clip", "optimizer step")


def config(output_dir: str, steps: int, work: dict) -> GRPOConfig:
    batch = work["prompts"] * work["samples"]
    micro = min(MICRO, batch)
    return grpo_config(
        output_dir=output_dir,
        use_cpu=True,
        bf16=False,
        gradient_checkpointing=False,
        per_device_train_batch_size=micro,
        gradient_accumulation_steps=batch // micro,
        num_generations=work["samples"],
        max_completion_length=work["max_tokens"],
        temperature=1.0,
        learning_rate=LR,
        max_grad_norm=1.0,
        epsilon=0.2,
        scale_rewards="group",
        max_steps=steps,
        seed=0,
        logging_steps=1,
    )


def stages(regions: Regions, lengths: list[list[int]]) -> tuple[dict, dict]:
    """Per stage, the median after the first step of its seconds (generate, reward, update: the
    forward, backward, loss, clip and optimizer regions) and tokens/s (generate, update)."""
    seconds, rates = [], []
    for step, responses in zip(regions.steps[1:], lengths[1:], strict=True):
        stage = {
            "generate": step.get("rollout: generate", 0.0),
            "reward": step.get("rollout: reward", 0.0),
            "update": sum(step.get(name, 0.0) for name in UPDATE_REGIONS),
        }
        tokens = sum(responses) + PROMPT_TOKENS * len(responses)
        seconds.append(stage)
        rates.append({name: tokens / stage[name] for name in ("generate", "update")})
    return _medians(seconds), _medians(rates)


def _medians(steps: list[dict[str, float]]) -> dict[str, float]:
    return {name: round(value, 4) for name, value in medians(steps).items()}


def train(model_dir: str, prompts_file: str, steps: int, work: dict, output_dir: str) -> dict:
    rows = [json.loads(line) for line in Path(prompts_file).read_text().splitlines()]
    regions = Regions()
    install_trl(regions)
    timer = StepTimer(regions)
    trainer = GRPOTrainer(
        model=load_actor(model_dir, dtype=torch.float32),
        reward_funcs=length_hash_reward,
        args=config(output_dir, steps, work),
        train_dataset=Dataset.from_list(rows),
        processing_class=load_tokenizer(model_dir),
        callbacks=[timer],
    )
    trainer.train()
    lengths = [json.loads(line) for line in Path(os.environ[LENGTHS_ENV]).read_text().splitlines()]
    stage_seconds, tokens_per_s = stages(regions, lengths)
    return {
        "step_seconds": [round(s, 3) for s in timer.seconds],
        "stage_seconds": stage_seconds,
        "tokens_per_s": tokens_per_s,
        "profile": regions.medians(),
        "trl_version": trl.__version__,
    }


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--prompts-file", required=True)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--work", type=json.loads, required=True, help="prompts, samples, max_tokens")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    result = train(args.model, args.prompts_file, args.steps, args.work, str(args.out.parent / "trl-output"))
    args.out.write_text(json.dumps(result))
