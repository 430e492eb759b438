"""What every TRL side shares (``trl_grpo``, ``trl_grpo_qwen``, and the children of ``memory_vs_trl`` and
``update_throughput_vs_trl``): GRPOConfig's common settings, a trainer on a fixed batch, the step timer.
Runs where TRL is installed (``.venv-bench``)."""

from __future__ import annotations

from datasets import Dataset
from transformers import TrainerCallback
from trl import GRPOConfig, GRPOTrainer

from benchmarks.common import StepClock
from benchmarks.step_profile import Regions

QUIET = {
    "lr_scheduler_type": "constant",
    "beta": 0.0,
    "loss_type": "dapo",
    "report_to": "none",
    "save_strategy": "no",
    "disable_tqdm": True,
    "dataloader_num_workers": 0,
}
"""What every TRL side sets alike: a constant learning rate, no KL, the token-mean loss, and no reports,
saves, progress bars or loader workers."""


def grpo_config(**settings) -> GRPOConfig:
    """TRL's ``GRPOConfig`` with ``QUIET`` and ``settings`` (the run's own: sizes, lengths, rates)."""
    return GRPOConfig(**QUIET, **settings)


def never_called(completions, **kwargs) -> list[float]:
    """TRL's reward function: the fixed batch comes with its advantages, so nothing is scored."""
    raise AssertionError("the fixed batch replaces generation and scoring")


def fixed_batch_trainer(data: dict, device: str = "cpu", **kwargs) -> GRPOTrainer:
    """A ``GRPOTrainer`` (``kwargs``: model, args, processing_class, callbacks) whose generation and
    scoring hand back ``data`` on ``device``: a fixed batch with its advantages (``memory_vs_trl.
    fixed_batch``, ``update_throughput_vs_trl.fixed_batch``), so each step is an update on it."""
    import torch

    target = torch.device(device)
    inputs = {
        "prompt_ids": data["prompt_ids"].to(target),
        "prompt_mask": data["prompt_mask"].to(target),
        "completion_ids": data["response_ids"].to(target),
        "completion_mask": data["response_mask"].to(target),
        "advantages": data["advantages"].to(target),
        "num_items_in_batch": data["response_mask"].sum().to(target),
    }

    class FixedBatchGRPOTrainer(GRPOTrainer):
        def _generate_and_score_completions(self, generation_inputs):
            return dict(inputs)

    batch = len(data["scores"])
    return FixedBatchGRPOTrainer(
        reward_funcs=never_called, train_dataset=Dataset.from_list([{"prompt": "1+1="}] * batch), **kwargs
    )


class StepTimer(StepClock, TrainerCallback):
    """``StepClock`` between the ends of consecutive optimizer steps (the first from the start of
    training), each also closing a step of ``regions``."""

    def __init__(self, regions: Regions) -> None:
        super().__init__(after_step=lambda: regions.end_step(self.seconds[-1]))
        self.regions = regions

    def on_train_begin(self, args, state, control, **kwargs):
        self.start()

    def on_step_end(self, args, state, control, **kwargs):
        self.step_end()
