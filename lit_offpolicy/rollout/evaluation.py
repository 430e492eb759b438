"""Validation of a policy: greedy exact-match accuracy, mean reward and pass@k over prompt batches."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import lightning as L
import torch

from lit_offpolicy.core.checks import check_range
from lit_offpolicy.core.distributed import sum_over_ranks
from lit_offpolicy.data import batch_problems
from lit_offpolicy.rewards import RewardInputs, RewardOutput
from lit_offpolicy.rollout import RolloutEngine, SamplingParams

if TYPE_CHECKING:
    from lit_offpolicy.rollout.agents import AgentRunner
    from lit_offpolicy.rollout.episodes import EpisodeRunner


@dataclass(frozen=True)
class ValidationConfig:
    """Evaluation of the rollout engine's policy on the data module's validation prompts."""

    every_n_steps: int | None = 10
    """RL steps between evaluations, and one before the first; None or 0: none. A multiple of
    ``sync_every``: the engine holds the actor's weights only right after a sync."""
    pass_k: int = 1
    """Samples per prompt at the sampling temperature for ``val/pass@k``; 1: greedy accuracy only."""
    stop_at: float | None = None
    """Stop training once ``val/accuracy`` has been at least this at ``stop_after`` consecutive
    evaluations; None: train for ``trainer.max_steps``. Needs evaluations (``every_n_steps``)."""
    stop_after: int = 1
    """Consecutive evaluations at or above ``stop_at`` that stop training (1: the first one)."""

    def __post_init__(self) -> None:
        check_range("validation.every_n_steps", self.every_n_steps or 0, low=0)
        check_range("validation.pass_k", self.pass_k, low=1)
        if self.stop_at is not None:
            check_range("validation.stop_at", self.stop_at, low=0.0, high=1.0)
            if not self.every:
                raise ValueError(
                    f"validation.stop_at={self.stop_at} needs evaluations: set validation.every_n_steps "
                    f"(got {self.every_n_steps})"
                )
        check_range("validation.stop_after", self.stop_after, low=1)

    @property
    def every(self) -> int:
        """``every_n_steps`` with None as 0."""
        return self.every_n_steps or 0

    def target(self) -> AccuracyTarget | None:
        """A fresh early-stopping target for ``stop_at``/``stop_after``; None without ``stop_at``."""
        return None if self.stop_at is None else AccuracyTarget(self.stop_at, self.stop_after)


@torch.no_grad()
def evaluate(
    engine: RolloutEngine,
    tokenizer,
    batches: Iterable[dict],
    reward_fn: Callable[[RewardInputs], RewardOutput],
    max_tokens: int,
    add_special_tokens: bool = True,
    pass_k_params: SamplingParams | None = None,
    device: torch.device | str = "cpu",
    sources: Sequence[str] = (),
    episodes: EpisodeRunner | AgentRunner | None = None,
) -> dict[str, float]:
    """``val/accuracy``, ``val/reward`` and ``val/pass@k`` of the engine on the validation batches.

    ``val/accuracy``: the share of greedy answers scoring ≥ 1; ``val/reward``: their mean score;
    with ``pass_k_params`` (k = its n), ``val/pass@k``: the share of prompts with a correct sample
    among k.

    ``batches`` yield ``data.collate_prompts`` batches; no prompt at all gives ``{}``. ``sources``:
    the ``data_source`` values of the whole validation set (``validation_sources``); each adds
    ``val/<source>/accuracy`` and ``val/<source>/reward`` over its rows. Under data parallelism each
    rank passes its share of the prompts (``PromptDataModule.val_dataloader``) and every rank calls
    this with the same ``sources``: the counts are summed over the ranks (on ``device``, the
    backend's), so every rank returns the metrics of the whole set. ``episodes``: answer with
    multi-turn episodes (scored on their last turn plus the environment's rewards), greedy turns too.
    """
    greedy = SamplingParams(n=1, temperature=0.0, max_tokens=max_tokens)
    groups = ["", *sources]  # "": every row
    correct, reward, count = ([0.0] * len(groups) for _ in range(3))
    passed = 0.0
    for batch in batches:
        problems = batch_problems(batch)
        prompt_ids = tokenizer(list(batch["prompt"]), add_special_tokens=add_special_tokens).input_ids
        scores = _answer(
            engine, tokenizer, reward_fn, problems, prompt_ids, greedy, add_special_tokens, episodes
        )
        for problem, score in zip(problems, scores, strict=True):
            source = str(problem.get("columns", {}).get("data_source"))
            for index in (0, groups.index(source)) if source in sources else (0,):
                correct[index] += score >= 1.0
                reward[index] += score
                count[index] += 1
        if pass_k_params is not None:
            k = pass_k_params.n
            sampled = _answer(
                engine,
                tokenizer,
                reward_fn,
                problems,
                prompt_ids,
                pass_k_params,
                add_special_tokens,
                episodes,
            )
            passed += sum(max(sampled[i * k : (i + 1) * k]) >= 1.0 for i in range(len(prompt_ids)))
    *totals, passed = sum_over_ranks([*correct, *reward, *count, passed], device)
    correct, reward, count = (totals[i * len(groups) : (i + 1) * len(groups)] for i in range(3))
    if not count[0]:
        return {}
    metrics = {"val/accuracy": correct[0] / count[0], "val/reward": reward[0] / count[0]}
    for index, source in enumerate(sources, start=1):
        if count[index]:
            metrics[f"val/{source}/accuracy"] = correct[index] / count[index]
            metrics[f"val/{source}/reward"] = reward[index] / count[index]
    if pass_k_params is not None:
        metrics[f"val/pass@{pass_k_params.n}"] = passed / count[0]
    return metrics


def _answer(engine, tokenizer, reward_fn, problems, prompt_ids, params, add_special_tokens, episodes) -> list:
    """The scores of ``params.n`` answers to each problem: one generation each, or an episode each."""
    if episodes is not None:
        return episodes.episode_scores(engine, problems, params, reward_fn, add_special_tokens)
    samples = [g for group in engine.generate(prompt_ids, params) for g in group]
    texts = [tokenizer.decode(g.token_ids, skip_special_tokens=True) for g in samples]
    return reward_fn(RewardInputs.of(problems, texts, [g.token_ids for g in samples], params.n)).scores


def validation_sources(problems: Iterable[dict] | None) -> list[str]:
    """The distinct ``data_source`` values of validation rows (verl's column), sorted."""
    found = {p.get("columns", {}).get("data_source") for p in problems or ()}
    return sorted(str(source) for source in found if source is not None and str(source))


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
    """The ``val/accuracy`` to reach (``stop_at``)."""
    evaluations: int = 1
    """Consecutive evaluations it must hold for (``stop_after``)."""
    held: int = 0
    """Consecutive evaluations at or above the threshold so far (kept in checkpoints)."""

    def __post_init__(self) -> None:
        check_range("stop_at", self.threshold, low=0.0, high=1.0)
        check_range("stop_after", self.evaluations, low=1)

    def reached(self, accuracy: float) -> bool:
        """Count one evaluation; whether the target is now reached."""
        self.held = self.held + 1 if accuracy >= self.threshold else 0
        return self.held >= self.evaluations

    def stop_line(self, accuracy: float, trainer: L.Trainer, options: str) -> str:
        """What stopped training, once ``reached``: the step, the rule, its options (named with the
        prefix ``options``: ``ValAccuracy.``, ``validation.``) and the values."""
        bound = f" of trainer.max_steps={trainer.max_steps}" if trainer.max_steps > 0 else ""
        return (
            f"lit-offpolicy: stopped at step {trainer.global_step}{bound}: val/accuracy {accuracy:.4g} >= "
            f"{options}stop_at={self.threshold} at {self.held} evaluation(s) in a row "
            f"({options}stop_after={self.evaluations})"
        )
