"""Loss overhead: policy loss + advantage + rollout correction as a fraction of the training step.

On the fixed batch of ``benchmarks.pytorch.train_step`` (128 prompts × 4 samples, GRPO, PPO clipped loss,
token-level truncated IS correction ``token_tis``), the whole training step is timed as a Trainer runs
it; then, on the very tensors that step used, the three pure-tensor stages are timed alone:
token rewards + GRPO advantages, ``RolloutCorrection.compute`` and the policy loss's forward and
backward (to the log-probs). Each stage is the median over ``--repeats`` of the mean of 10 calls.
ours = their sum, baseline = the step; ratio = step / stages (higher: cheaper stages), fraction = its
inverse.

    python -m benchmarks.pytorch.loss_overhead [--repeats 5]
"""

from __future__ import annotations

import tempfile

from benchmarks.common import (
    StepTimer,
    entry,
    fit_on_fixed_experience,
    fixed_experience,
    fresh,
    median,
    timed,
)
from benchmarks.pytorch.train_step import WARMUP_STEPS, build_module
from benchmarks.results import repeats_main
from lit_offpolicy.advantages import token_level_rewards
from lit_offpolicy.core.experience import Experience
from lit_offpolicy.models import create_tiny_model, load_tokenizer

CALLS = 10
CORRECTION = "token_tis"


def per_call_seconds(fn, repeats: int) -> float:
    """The median over ``repeats`` of the mean seconds of ``CALLS`` calls, after one warm-up call."""
    fn()  # warm-up

    def calls() -> None:
        for _ in range(CALLS):
            fn()

    return median([timed(calls)[0] / CALLS for _ in range(repeats)])


def stage_seconds(module, exp: Experience, repeats: int) -> dict[str, float]:
    """Seconds per call of each pure-tensor stage on ``exp`` (prepared by a training step)."""
    mask = exp.response_mask

    def advantage():
        rewards = token_level_rewards(exp.scores, mask)
        return module.advantage(rewards, mask, values=exp.values, group_ids=exp.group_ids)

    def correction():
        return module.correction.compute(
            old_log_probs=exp.old_log_probs, rollout_log_probs=exp.rollout_log_probs, response_mask=mask
        )

    log_probs = exp.old_log_probs.detach().clone().requires_grad_(True)

    def policy_loss():
        out = module.policy_loss(
            log_probs=log_probs,
            old_log_probs=exp.old_log_probs,
            advantages=exp.advantages,
            response_mask=exp.loss_mask,
            scores=exp.scores,
            is_weights=exp.is_weights,
        )
        out.loss.backward()
        log_probs.grad = None

    return {
        "advantage": per_call_seconds(advantage, repeats),
        "correction": per_call_seconds(correction, repeats),
        "policy_loss": per_call_seconds(policy_loss, repeats),
    }


def main(repeats: int = 5) -> list[dict]:
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = str(create_tiny_model(f"{tmp}/tiny"))
        exp = fixed_experience(load_tokenizer(model_dir))
        module = build_module(model_dir, "grpo", rollout_correction=CORRECTION)
        print(f"[loss_overhead] {repeats} GRPO steps after a warm-up, then the stages alone", flush=True)
        timer = StepTimer()
        fit_on_fixed_experience(module, exp, WARMUP_STEPS + repeats, [timer], tmp)
        prepared = fresh(exp)
        module.prepare(prepared)  # the tensors the step's loss saw, from the trained actor
        stages = stage_seconds(module, prepared, repeats)
    step = median(timer.seconds[WARMUP_STEPS:])
    overhead = sum(stages.values())
    return [
        entry(
            "loss_overhead",
            "s",
            overhead,
            step,
            repeats,
            fraction=round(overhead / step, 4),
            stages_s={name: round(value, 5) for name, value in stages.items()},
            workload=(
                f"GRPO + PPO loss + {CORRECTION} correction, {len(exp)} samples x "
                f"{exp.response_ids.shape[1]} response positions, tiny Llama float32"
            ),
            what="ours: token rewards + advantages + correction + policy loss fwd/bwd; baseline: one step",
        )
    ]


if __name__ == "__main__":
    repeats_main(main, __doc__)
