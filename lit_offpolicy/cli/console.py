"""What a run prints: messages a user cannot act on are left out, each by its text.

Lightning's that do not apply to RL training, DeepSpeed's accelerator guess and Lightning's model
summary table (one line instead, :class:`OneLineModelSummary`). Only these exact messages are filtered,
and only where they are made; every other warning still reaches the console. vLLM's own log goes to a
file (``VLLMEngineSpec.log_level``, docs/rollout_engines.md).
"""

from __future__ import annotations

import logging
import warnings
from typing import Any

from lightning.pytorch.callbacks import ModelSummary

# (message regex, why it does not apply here)
IRRELEVANT_LIGHTNING_WARNINGS = (
    (
        r"You passed in a `val_dataloader` but have no `validation_step`",
        "the validation prompts feed the rollout callbacks' evaluation, not a Lightning validation loop",
    ),
    (
        r"Using ModelCheckpoint with manual optimization",
        "a checkpoint after the RL step is meant to hold the updated policy",
    ),
    (
        r"Found \d+ module\(s\) in eval mode at the start of training",
        "the frozen reference model is in eval mode on purpose",
    ),
    (
        r"You're resuming from a checkpoint that ended before the epoch ended and your dataloader is",
        "the data position is resumed by the data module's sampler (ResumableShuffleSampler), which "
        "Lightning does not look at",
    ),
    (
        r"The '\w+_dataloader' does not have many workers which may be a bottleneck",
        "the data loaders yield prompts (a few strings per step); the step's time is generation and update",
    ),
    (
        r"Precision [\w-]+ is not supported by the model summary",
        "the summary's estimate of the model's size in MB, not the training, is what it affects",
    ),
    (
        r"`isinstance\(treespec, LeafSpec\)` is deprecated",
        "raised inside Lightning about its own use of torch's pytree",
    ),
)
# raised by lightning.fabric wherever `srun` is on the PATH (a SLURM login node); SLURM runs are
# started by the sbatch scripts of docs/slurm.md, which use srun
IRRELEVANT_FABRIC_WARNINGS = (r"The `srun` command is available on your system but is not used",)
# an advertisement for a cloud logger, printed at every start
IRRELEVANT_LIGHTNING_INFO = ("litlogger",)
# (logger, message fragments): log lines of other libraries that say nothing to act on
IRRELEVANT_LOG_LINES = (
    # Lightning's note at every resume: lit-offpolicy's checkpoints hold optimizer state, not only tensors
    ("lightning.pytorch.trainer.connectors.checkpoint_connector", ("`weights_only` was not set",)),
    # DeepSpeed, imported by transformers at the export, guessing the accelerator of a CPU run
    ("DeepSpeed", ("Setting accelerator to CPU",)),
)


class _DropMessages(logging.Filter):
    def __init__(self, fragments: tuple[str, ...]) -> None:
        super().__init__()
        self.fragments = fragments

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not any(fragment in message for fragment in self.fragments)


def quiet_lightning() -> None:
    """Filter the messages above (idempotent)."""
    for message, _why in IRRELEVANT_LIGHTNING_WARNINGS:
        warnings.filterwarnings("ignore", message=message, module=r"lightning\.pytorch\.")
    for message in IRRELEVANT_FABRIC_WARNINGS:
        warnings.filterwarnings("ignore", message=message)
    lines = [
        (name, IRRELEVANT_LIGHTNING_INFO)
        for name in ("lightning.pytorch.utilities.rank_zero", "lightning.fabric.utilities.rank_zero")
    ]
    for name, fragments in [*lines, *IRRELEVANT_LOG_LINES]:
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropMessages) for f in logger.filters):
            logger.addFilter(_DropMessages(fragments))


class OneLineModelSummary(ModelSummary):
    """Lightning's model summary as one line (parameters, trainable and frozen), not a 13-line table."""

    @staticmethod
    def summarize(
        summary_data: list[tuple[str, list[str]]],
        total_parameters: int,
        trainable_parameters: int,
        model_size: float,
        total_training_modes: dict[str, int],
        total_flops: int = 0,
        **summarize_kwargs: Any,
    ) -> None:
        frozen = total_parameters - trainable_parameters
        columns = dict(summary_data)
        names, types = columns.get("Name", []), columns.get("Type", [])
        parts = ", ".join(f"{name} {kind}" for name, kind in zip(names, types, strict=True))
        logging.getLogger("lightning.pytorch.callbacks.model_summary").info(
            f"model: {parts} ({trainable_parameters / 1e6:.1f} M parameters trained, "
            f"{frozen / 1e6:.1f} M frozen)"
        )
