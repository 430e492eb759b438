"""Validation of a policy: greedy exact-match accuracy, mean reward and pass@k over prompt batches."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import lightning as L
import torch

from lit_offpolicy.checks import check_range
from lit_offpolicy.distributed import sum_over_ranks
from lit_offpolicy.rewards import RewardFn
from lit_offpolicy.rollout import RolloutEngine, SamplingParams


@torch.no_grad()
def evaluate(
    engine: RolloutEngine,
    tokenizer,
    batches: Iterable[dict],
    reward_fn: RewardFn,
    max_tokens: int,
    add_special_tokens: bool = True,
    pass_k_params: SamplingParams | None = None,
    device: torch.device | str = "cpu",
) -> dict[str, float]:
    """``val/accuracy`` (share of greedy answers scoring ≥ 1), ``val/reward`` (their mean score) and,
    with ``pass_k_params`` (k = its n), ``val/pass@k`` (share of prompts with a correct sample among k).

    ``batches`` yield ``{"prompt": [...], "answer": [...]}``; no prompt at all gives ``{}``. Under
    data parallelism each rank passes its share of the prompts (``PromptDataModule.val_dataloader``)
    and every rank calls this: the counts are summed over the ranks (on ``device``, the backend's),
    so every rank returns the metrics of the whole set.
    """
    greedy = SamplingParams(n=1, temperature=0.0, max_tokens=max_tokens)
    correct = reward = passed = 0.0
    count = 0
    for batch in batches:
        prompt_ids = tokenizer(list(batch["prompt"]), add_special_tokens=add_special_tokens).input_ids
        texts = [
            tokenizer.decode(g[0].token_ids, skip_special_tokens=True)
            for g in engine.generate(prompt_ids, greedy)
        ]
        scores = reward_fn(texts, list(batch["answer"])).scores
        correct += sum(score >= 1.0 for score in scores)
        reward += sum(scores)
        count += len(scores)
        if pass_k_params is not None:
            k = pass_k_params.n
            groups = engine.generate(prompt_ids, pass_k_params)
            texts = [
                tokenizer.decode(g.token_ids, skip_special_tokens=True) for group in groups for g in group
            ]
            sampled = reward_fn(texts, [a for a in batch["answer"] for _ in range(k)]).scores
            passed += sum(max(sampled[i * k : (i + 1) * k]) >= 1.0 for i in range(len(prompt_ids)))
    correct, reward, passed, count = sum_over_ranks([correct, reward, passed, count], device)
    if not count:
        return {}
    metrics = {"val/accuracy": correct / count, "val/reward": reward / count}
    if pass_k_params is not None:
        metrics[f"val/pass@{pass_k_params.n}"] = passed / count
    return metrics


def publish(trainer: L.Trainer, metrics: dict[str, float]) -> None:
    """Log ``metrics`` at the current global step to every logger, and expose them as callback metrics."""
    for logger in trainer.loggers:
        logger.log_metrics(metrics, step=trainer.global_step)
    trainer.callback_metrics.update({name: torch.tensor(value) for name, value in metrics.items()})


@dataclass
class AccuracyTarget:
    """Early stopping on validation: the target is reached once ``val/accuracy`` ≥ ``threshold`` at
    ``evaluations`` consecutive evaluations (1: the first time it gets there)."""

    threshold: float
    evaluations: int = 1
    held: int = 0  # consecutive evaluations at or above the threshold so far

    def __post_init__(self) -> None:
        check_range("stop_at", self.threshold, low=0.0, high=1.0)
        check_range("stop_after", self.evaluations, low=1)

    def reached(self, accuracy: float) -> bool:
        """Count one evaluation; whether the target is now reached."""
        self.held = self.held + 1 if accuracy >= self.threshold else 0
        return self.held >= self.evaluations
