"""What a run prints: Lightning's messages that do not apply to RL training are left out, each by its text.

Only these exact messages are filtered, and only where Lightning raises them; every other warning
still reaches the console.
"""

from __future__ import annotations

import logging
import warnings

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
# an advertisement for a cloud logger, printed at every start
IRRELEVANT_LIGHTNING_INFO = ("litlogger",)


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
    for name in ("lightning.pytorch.utilities.rank_zero", "lightning.fabric.utilities.rank_zero"):
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropMessages) for f in logger.filters):
            logger.addFilter(_DropMessages(IRRELEVANT_LIGHTNING_INFO))
