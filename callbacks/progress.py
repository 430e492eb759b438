"""StepProgress: one progress bar over the run's RL steps (or training steps) and its main metrics."""

from __future__ import annotations

import math

import lightning as L
from lightning.pytorch.callbacks import TQDMProgressBar

from lit_offpolicy.callbacks.rollout import Rollout
from lit_offpolicy.training.checks import optimizer_steps_per_rl_step

DEFAULT_METRICS = ("reward/mean", "val/accuracy", "actor/pg_loss", "sft/loss")


def rl_step_size(pl_module: L.LightningModule, datamodule, callbacks: list) -> int | None:
    """Optimizer steps (``trainer.global_step``) per RL step at most: ``update.ppo_epochs`` × the
    mini-batches of a step's ``data.batch_size`` × ``sampling.n`` samples per rank; None: no RL steps."""
    update = getattr(pl_module, "update_options", None)
    rollouts = [callback for callback in callbacks if isinstance(callback, Rollout)]
    batch_size = getattr(datamodule, "batch_size", None)
    if update is None or not rollouts or not isinstance(batch_size, int):
        return None
    return optimizer_steps_per_rl_step(update, batch_size * rollouts[0].worker.sampling.n)


class StepProgress(TQDMProgressBar):
    """A progress bar over the run's steps with the latest value of each of ``metrics``.

    An RL run counts RL steps (``pl_module.policy_version``, labelled "RL step"); ``trainer.max_steps``
    counts optimizer steps, several per RL step with mini-batches or ``ppo_epochs`` > 1, so the total is
    the RL steps that fit in the optimizer steps left (updated after each step, as dynamic sampling can
    make fewer), or those ``max_epochs`` allows. Other modules (SFT) count ``trainer.global_step``.
    RL runs have no meaningful epochs; a metric shows where the run logs it (``val/accuracy``: the
    last evaluation's).

    Args:
        metrics: metric names to show, in order; names the run never logs are left out.
        refresh_rate: steps between updates of the bar.
    """

    def __init__(self, metrics: list[str] | tuple[str, ...] = DEFAULT_METRICS, refresh_rate: int = 1) -> None:
        super().__init__(refresh_rate=refresh_rate)
        self.metrics = tuple(metrics)
        self.per_rl_step: int | None = None

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        super().on_train_start(trainer, pl_module)
        # here, not at an epoch's start: a run resumed from a mid-epoch checkpoint (a ModelCheckpoint's,
        # what a killed run resumes from) starts without one
        self.per_rl_step = rl_step_size(pl_module, trainer.datamodule, trainer.callbacks)
        bar = self.train_progress_bar
        bar.reset(total=self.total(trainer, pl_module))
        bar.n = bar.initial = self.step(trainer, pl_module)  # a resumed run starts part-way; tqdm's
        bar.set_description("step" if self.per_rl_step is None else "RL step")  # rate: (n − initial) / time

    def on_train_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """The bar spans the run, not an epoch: Lightning's reset at each epoch is left out."""

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException):
        """A run that ends with an error closes the bar, ending its line: the one line the CLI prints
        for the error goes below it, not after it."""
        if self._train_progress_bar is not None:
            self._train_progress_bar.close()

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs, batch, batch_idx):
        bar = self.train_progress_bar
        step = self.step(trainer, pl_module)
        if self.per_rl_step is not None:
            bar.total = self.total(trainer, pl_module)
        if self._should_update(step, bar.total):
            bar.n = step
            bar.set_postfix(self.get_metrics(trainer, pl_module), refresh=True)

    def step(self, trainer: L.Trainer, pl_module: L.LightningModule) -> int:
        """RL steps done (``policy_version``) in an RL run, else optimizer steps (``global_step``)."""
        return trainer.global_step if self.per_rl_step is None else int(pl_module.policy_version)

    def total(self, trainer: L.Trainer, pl_module: L.LightningModule) -> int | None:
        """The steps the run will have made when ``max_steps`` or ``max_epochs`` stops it (never fewer
        than those done); None only for a run that neither bounds (an endless data stream)."""
        if self.per_rl_step is None:
            bound = trainer.estimated_stepping_batches
            return None if math.isinf(bound) else max(int(bound), trainer.global_step)
        done = self.step(trainer, pl_module)
        bounds = []
        if trainer.max_steps > 0:
            left = max(trainer.max_steps - trainer.global_step, 0)
            bounds.append(done + math.ceil(left / self.per_rl_step))
        batches, epochs = trainer.num_training_batches, trainer.max_epochs
        if epochs is not None and epochs > 0 and not math.isinf(batches):
            bounds.append(int(batches) * epochs)
        return max(min(bounds), done) if bounds else None

    def get_metrics(self, trainer: L.Trainer, pl_module: L.LightningModule) -> dict[str, str]:
        shown = {}
        for name in self.metrics:
            value = trainer.callback_metrics.get(name)
            if value is not None:
                shown[name] = f"{float(value):.3g}"
        return shown
