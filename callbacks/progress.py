"""StepProgress: one progress bar over the run's training steps, with the metrics that matter."""

from __future__ import annotations

import lightning as L
from lightning.pytorch.callbacks import TQDMProgressBar

DEFAULT_METRICS = ("reward/mean", "val/accuracy", "actor/pg_loss", "sft/loss")


class StepProgress(TQDMProgressBar):
    """A progress bar over ``trainer.max_steps`` with the latest value of each of ``metrics``.

    RL runs have no meaningful epochs; a metric shows where the run logs it (``val/accuracy``: the
    last evaluation's).

    Args:
        metrics: metric names to show, in order; names the run never logs are left out.
        refresh_rate: steps between updates of the bar.
    """

    def __init__(self, metrics: list[str] | tuple[str, ...] = DEFAULT_METRICS, refresh_rate: int = 1) -> None:
        super().__init__(refresh_rate=refresh_rate)
        self.metrics = tuple(metrics)

    def on_train_epoch_start(self, trainer: L.Trainer, *_) -> None:
        bar = self.train_progress_bar
        # once, not every epoch; a resumed run starts part-way
        if trainer.current_epoch == 0 or bar.total is None:
            bar.reset(total=trainer.max_steps if trainer.max_steps > 0 else None)
            bar.initial = trainer.global_step
            bar.set_description("step")

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs, batch, batch_idx):
        bar = self.train_progress_bar
        if self._should_update(trainer.global_step, bar.total):
            bar.n = trainer.global_step
            bar.set_postfix(self.get_metrics(trainer, pl_module), refresh=True)

    def get_metrics(self, trainer: L.Trainer, pl_module: L.LightningModule) -> dict[str, str]:
        shown = {}
        for name in self.metrics:
            value = trainer.callback_metrics.get(name)
            if value is not None:
                shown[name] = f"{float(value):.3g}"
        return shown
