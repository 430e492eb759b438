"""TensorBoard: the trainer's writers (for histograms and text), and scalars read back from event files."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import lightning as L
from lightning.pytorch.loggers import TensorBoardLogger
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator


def latest_run(log_dir: str | Path) -> Path:
    """The newest ``version_N`` directory that Lightning's TensorBoardLogger wrote under ``log_dir``."""
    runs = sorted(Path(log_dir).glob("version_*"), key=lambda p: int(p.name.split("_")[-1]))
    if not runs:
        raise FileNotFoundError(f"no version_* run under {log_dir}")
    return runs[-1]


def read_scalars(run_dir: str | Path, tag: str) -> list[tuple[int, float]]:
    """(step, value) pairs of scalar ``tag`` in ``run_dir``, in step order; empty if never logged."""
    events = EventAccumulator(str(run_dir), size_guidance={"scalars": 0})
    events.Reload()
    if tag not in events.Tags()["scalars"]:
        return []
    return [(event.step, event.value) for event in events.Scalars(tag)]


def tensorboard_experiments(trainer: L.Trainer) -> Iterator:
    """The ``SummaryWriter`` of each of the trainer's TensorBoard loggers (none without one)."""
    for logger in trainer.loggers:
        if isinstance(logger, TensorBoardLogger):
            yield logger.experiment
