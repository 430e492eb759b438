"""Rollout correction for the three-policy setting (π_rollout, π_old, π_θ).

Importance weights, rejection and veto masks, presets, off-policy metrics and the pure-IS loss.

See docs/rollout_correction.md for the math, the presets and the metric glossary.
"""

from lit_offpolicy.correction.metrics import is_weight_metrics, offpolicy_metrics
from lit_offpolicy.correction.pure_is import pure_is_policy_loss
from lit_offpolicy.correction.ratios import IS_LEVELS, RS_LEVELS, SAFETY_BOUND
from lit_offpolicy.correction.rollout_correction import (
    PRESETS,
    RolloutCorrection,
    RolloutCorrectionOutput,
    resolve_rollout_correction,
)

__all__ = [
    "IS_LEVELS",
    "PRESETS",
    "RS_LEVELS",
    "SAFETY_BOUND",
    "RolloutCorrection",
    "RolloutCorrectionOutput",
    "is_weight_metrics",
    "offpolicy_metrics",
    "pure_is_policy_loss",
    "resolve_rollout_correction",
]
