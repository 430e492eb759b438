"""Where a training step's seconds go: wall time split over named regions of the code, per step.

``Regions.wrap(owner, attribute, name)`` replaces a method or function by one that times its calls.
Time is *exclusive*: a second belongs to the innermost wrapped call running at that moment, so the
regions of a step never overlap and ``other`` (the step's seconds minus all regions) is what no region
covers (the training loop, callbacks, data). ``install_ours`` and ``install_trl`` wrap the matching
stages of OffPolicyModule + Rollout and of TRL's GRPOTrainer; ``benchmarks.peers.end_to_end_trl`` reports
both sides' medians. The wrappers add a few microseconds per call, tens of calls a step.
"""

from __future__ import annotations

import functools
import time
from collections import defaultdict

from benchmarks.common import median


class Regions:
    """Exclusive wall seconds per region name, collected step by step (``end_step``)."""

    def __init__(self) -> None:
        self.steps: list[dict[str, float]] = []
        self._current: dict[str, float] = defaultdict(float)
        self._stack: list[str] = []
        self._mark = 0.0

    def wrap(self, owner, attribute: str, name: str) -> None:
        original = getattr(owner, attribute)

        @functools.wraps(original)
        def timed(*args, **kwargs):
            self._enter(name)
            try:
                return original(*args, **kwargs)
            finally:
                self._exit()

        setattr(owner, attribute, timed)

    def _enter(self, name: str) -> None:
        now = time.perf_counter()
        if self._stack:
            self._current[self._stack[-1]] += now - self._mark
        self._stack.append(name)
        self._mark = now

    def _exit(self) -> None:
        now = time.perf_counter()
        self._current[self._stack.pop()] += now - self._mark
        self._mark = now

    def end_step(self, step_seconds: float) -> None:
        """Close a step of ``step_seconds``: what the regions did not cover becomes ``other``."""
        regions = dict(self._current)
        regions["other"] = step_seconds - sum(regions.values())
        self.steps.append(regions)
        self._current = defaultdict(float)

    def medians(self, skip_first: int = 1) -> dict[str, float]:
        """Each region's median seconds over the steps after the first ``skip_first`` (warm-up)."""
        steps = self.steps[skip_first:] or self.steps
        names = {name for step in steps for name in step}
        return {name: round(median([step.get(name, 0.0) for step in steps]), 4) for name in sorted(names)}


def install_ours(regions: Regions) -> None:
    """Time OffPolicyModule's stages and the Rollout callback's (HF engine) around them."""
    import torch

    import lit_offpolicy.module as module
    import lit_offpolicy.training.update as update
    from lit_offpolicy.callbacks import Rollout
    from lit_offpolicy.rewards.contract import WeightedRewards
    from lit_offpolicy.rewards.isolation import IsolatedReward
    from lit_offpolicy.rollout import HFEngine

    regions.wrap(Rollout, "on_train_batch_start", "rollout: rest (prompts, experience, metrics)")
    regions.wrap(HFEngine, "generate", "rollout: generate")
    regions.wrap(WeightedRewards, "__call__", "rollout: reward")
    regions.wrap(IsolatedReward, "__call__", "rollout: reward")
    regions.wrap(HFEngine, "load_weights", "weight sync")
    regions.wrap(module.OffPolicyModule, "prepare", "prepare (π_old, reference, advantages)")
    regions.wrap(module.OffPolicyModule, "micro_batch_loss", "loss terms and their metrics")
    regions.wrap(update, "policy_log_probs", "forward")
    regions.wrap(module.OffPolicyModule, "manual_backward", "backward")
    regions.wrap(module.OffPolicyModule, "_step_is_finite", "non-finite guard")
    regions.wrap(module.OffPolicyModule, "clip_gradients_norm", "grad-norm clip")
    regions.wrap(torch.optim.AdamW, "step", "optimizer step")
    regions.wrap(module.OffPolicyModule, "log_dict", "logging")
    regions.wrap(module, "reduce_metrics", "logging")
    regions.wrap(module, "step_peak_memory", "logging")


def install_trl(regions: Regions) -> None:
    """Time GRPOTrainer's stages (TRL 1.16): the same regions under TRL's names."""
    import torch
    from accelerate import Accelerator
    from transformers import GenerationMixin
    from trl import GRPOTrainer

    rest = "rollout: rest (prompts, experience, metrics)"
    regions.wrap(GRPOTrainer, "_generate_and_score_completions", rest)
    regions.wrap(GenerationMixin, "generate", "rollout: generate")
    regions.wrap(GRPOTrainer, "_calculate_rewards", "rollout: reward")
    regions.wrap(GRPOTrainer, "_compute_loss", "loss terms and their metrics")
    regions.wrap(GRPOTrainer, "_get_per_token_logps_and_entropies", "forward")
    regions.wrap(Accelerator, "backward", "backward")
    regions.wrap(Accelerator, "clip_grad_norm_", "grad-norm clip")
    regions.wrap(torch.optim.AdamW, "step", "optimizer step")
    regions.wrap(GRPOTrainer, "log", "logging")
