"""Callbacks, the user-facing extension surface: rollouts, export. Import as ``lit_offpolicy.callbacks``."""

from lit_offpolicy.callbacks.export import HFExport
from lit_offpolicy.callbacks.rollout import Rollout
from lit_offpolicy.callbacks.val_accuracy import ValAccuracy

__all__ = ["HFExport", "Rollout", "ValAccuracy"]
