"""Training step throughput: OffPolicyModule under a Lightning Trainer against a bare PyTorch loop.

Both train the built-in tiny Llama on the same fixed batch of rollouts (128 prompts × 4 samples,
responses of 4..16 tokens; ``common.fixed_experience``) with the same math: π_old recompute, GRPO
advantages (or critic + GAE for PPO), PPO clipped loss with dual clip, token-mean, grad-norm clip 1.0,
one AdamW step per batch. Ours is the module's prepare() + update() as a real ``Trainer.fit`` drives it
(the experience handed in by a callback, as the Rollout callback does); the baseline is
``benchmarks.pytorch.bare_loop.step`` on deep copies of the same initial models. They alternate in one
process: after each of our steps the bare loop runs its step (timed apart), so drift on a shared
machine hits both alike. The first step of each is a warm-up; after it the two actors must agree
(``max_param_diff_after_first_step``: same math, same result). tokens/s = response tokens trained
per second.

    python -m benchmarks.pytorch.train_step [--repeats 5]
"""

from __future__ import annotations

import copy
import tempfile

import torch

from benchmarks.common import (
    StepTimer,
    entry,
    fit_on_fixed_experience,
    fixed_experience,
    median,
    timed,
)
from benchmarks.pytorch import bare_loop
from benchmarks.results import repeats_main
from lit_offpolicy import OffPolicyModule
from lit_offpolicy.advantages import GAE, GRPO
from lit_offpolicy.losses import PPO
from lit_offpolicy.models import create_tiny_model, load_tokenizer
from lit_offpolicy.training.options import OptimOptions

WARMUP_STEPS = 1
LR = 1e-4


def build_module(model_dir: str, algorithm: str, rollout_correction: str | None = None) -> OffPolicyModule:
    """GRPO (no critic) or PPO (critic on the same backbone, GAE), PPO clipped loss, token-mean."""
    ppo = algorithm == "ppo"
    return OffPolicyModule(
        model_dir,
        policy_loss=PPO(pg_clip=0.2, loss_agg_mode="token-mean"),
        advantage=GAE(gamma=1.0, lambd=0.95) if ppo else GRPO(norm_by_std=True),
        critic_path=model_dir if ppo else None,
        rollout_correction=rollout_correction,
        optim=OptimOptions(lr=LR),
    )


def bare_optimizer(actor, critic) -> torch.optim.Optimizer:
    """AdamW as the module builds it on the CPU: fused (``lit_offpolicy.training.optim.fused_applies``)."""
    groups = [{"params": list(actor.parameters()), "lr": LR}]
    if critic is not None:
        groups.append({"params": list(critic.parameters()), "lr": LR})
    return torch.optim.AdamW(groups, weight_decay=0.0, fused=True)


def max_param_diff(a: torch.nn.Module, b: torch.nn.Module) -> float:
    return max((p - q).abs().max().item() for p, q in zip(a.parameters(), b.parameters(), strict=True))


def measure(model_dir: str, exp, algorithm: str, repeats: int, root: str) -> dict:
    """Alternating steps of ours and the bare loop; per-step seconds of each (warm-up dropped)."""
    module = build_module(model_dir, algorithm)
    actor = copy.deepcopy(module.actor)
    critic = copy.deepcopy(module.critic)
    optimizer = bare_optimizer(actor, critic)
    bare_seconds: list[float] = []
    first_diff: list[float] = []

    def bare_step() -> None:
        bare_seconds.append(timed(lambda: bare_loop.step(actor, optimizer, exp, critic))[0])
        if not first_diff:
            first_diff.append(max_param_diff(module.actor, actor))

    timer = StepTimer(after_step=bare_step)
    fit_on_fixed_experience(module, exp, WARMUP_STEPS + repeats, [timer], root)
    return {
        "ours": timer.seconds[WARMUP_STEPS:],
        "bare": bare_seconds[WARMUP_STEPS:],
        "max_param_diff_after_first_step": first_diff[0],
    }


def main(repeats: int = 5) -> list[dict]:
    entries = []
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = str(create_tiny_model(f"{tmp}/tiny"))
        exp = fixed_experience(load_tokenizer(model_dir))
        tokens = int(exp.response_mask.sum())
        for algorithm in ("grpo", "ppo"):
            print(f"[train_step] {algorithm}: {repeats} alternating steps after a warm-up", flush=True)
            result = measure(model_dir, exp, algorithm, repeats, tmp)
            entries.append(
                entry(
                    f"train_step_vs_torch_{algorithm}",
                    "tokens/s",
                    tokens / median(result["ours"]),
                    tokens / median(result["bare"]),
                    repeats,
                    target=0.9,
                    workload=(
                        f"{algorithm.upper()} update on {len(exp)} samples (128 prompts x 4), "
                        f"{tokens} response tokens, tiny Llama float32"
                        + (" + critic" if algorithm == "ppo" else "")
                    ),
                    what="Trainer.fit of OffPolicyModule (prepare + update) vs a plain PyTorch loop",
                    seconds_ours=round(median(result["ours"]), 4),
                    seconds_baseline=round(median(result["bare"]), 4),
                    max_param_diff_after_first_step=float(f"{result['max_param_diff_after_first_step']:.2e}"),
                )
            )
    return entries


if __name__ == "__main__":
    repeats_main(main, __doc__)
