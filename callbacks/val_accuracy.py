"""ValAccuracy: greedy validation accuracy of the actor during any training (SFT warm-up included)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import lightning as L

from lit_offpolicy.core.checks import check_range
from lit_offpolicy.core.distributed import params_sharded
from lit_offpolicy.data import prompt_special_tokens
from lit_offpolicy.rewards import RewardConfig
from lit_offpolicy.rollout import HFEngine
from lit_offpolicy.rollout.evaluation import AccuracyTarget, evaluate, publish, validation_sources


class ValAccuracy(L.Callback):
    """Greedy ``val/accuracy`` and ``val/reward`` of ``pl_module.actor``, before training and periodically.

    With ``stop_at`` a warm-up ends robustly: SFT runs until the policy has *some* reward (say 0.3),
    however many steps that takes for a given seed, and RL starts from there.

    Args:
        every_n_steps: training steps between evaluations.
        max_response_length: tokens of a greedy answer, at most.
        reward: as the rollout callbacks' ``reward.fn`` (a short name, "pkg.module:name", an object or
            a list of them, summed); it runs in the trainer's process.
        stop_at: stop training once ``val/accuracy`` has been at least this at ``stop_after``
            consecutive evaluations; None: never.
        stop_after: consecutive evaluations at or above ``stop_at`` that stop training.
    """

    def __init__(
        self,
        every_n_steps: int = 25,
        max_response_length: int = 16,
        reward: str | list[str | Callable[..., Any]] | Callable[..., Any] = "exact",
        stop_at: float | None = None,
        stop_after: int = 1,
    ) -> None:
        self.every_n_steps = check_range("every_n_steps", every_n_steps, low=1)
        self.max_response_length = check_range("max_response_length", max_response_length, low=1)
        self.reward_fn = RewardConfig(fn=reward, timeout=None).build()
        self.target = None if stop_at is None else AccuracyTarget(stop_at, stop_after)

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        """Refuse sharded parameters: generating with the actor in place would run its all-gathers on
        every rank in lockstep, which the ranks' different validation shards cannot keep."""
        if params_sharded(trainer.strategy):
            raise ValueError(
                f"ValAccuracy evaluates the actor in place and needs each parameter whole on every rank; "
                f"strategy={type(trainer.strategy).__name__} shards them; allowed strategies: ddp, "
                "deepspeed_zero2 (the Rollout callback validates with its own engine under any strategy)"
            )

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._evaluate(trainer, pl_module)

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs, batch, batch_idx):
        if trainer.global_step % self.every_n_steps == 0:
            self._evaluate(trainer, pl_module)

    def _evaluate(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        datamodule = trainer.datamodule
        tokenizer = pl_module.tokenizer
        engine = HFEngine(pl_module.actor, tokenizer.eos_token_id, tokenizer.pad_token_id, copy_model=False)
        metrics = evaluate(
            engine,
            tokenizer,
            datamodule.val_dataloader(),
            self.reward_fn,
            max_tokens=self.max_response_length,
            add_special_tokens=prompt_special_tokens(datamodule),
            device=pl_module.device,
            sources=validation_sources(getattr(datamodule, "val_problems", None)),
        )
        if not metrics:
            return
        publish(trainer, metrics)
        if self.target is not None and self.target.reached(metrics["val/accuracy"]):
            trainer.should_stop = True
            # before trainer.max_steps: say which rule ended it (rank 0, above the progress bar)
            pl_module.print(self.target.stop_line(metrics["val/accuracy"], trainer, "ValAccuracy."))
