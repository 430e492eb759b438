"""Callbacks: the user-facing extension surface (rollouts, export, logging). Import as ``lit_offpolicy.callbacks``."""

from lit_offpolicy.callbacks.export import HFExport
from lit_offpolicy.callbacks.rollout import Rollout

__all__ = ["HFExport", "Rollout"]
