"""Callbacks, the user-facing extension surface: rollouts (synchronous and asynchronous), correction
logging, export, progress. Import as ``lit_offpolicy.callbacks``."""

from lit_offpolicy.callbacks.async_rollout import AsyncRollout
from lit_offpolicy.callbacks.correction_logger import RolloutCorrectionLogger
from lit_offpolicy.callbacks.export import HFExport
from lit_offpolicy.callbacks.progress import StepProgress
from lit_offpolicy.callbacks.rollout import Rollout
from lit_offpolicy.callbacks.val_accuracy import ValAccuracy

__all__ = ["AsyncRollout", "HFExport", "Rollout", "RolloutCorrectionLogger", "StepProgress", "ValAccuracy"]
