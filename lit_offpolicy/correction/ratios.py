"""Importance ratios between π_old and π_rollout: truncated IS weights, rejection and veto masks.

Every function takes the per-token log ratio r_t = log π_old(y_t) − log π_rollout(y_t) of a
(batch, T) batch and a boolean mask of its valid tokens, and reads r only where the mask holds.
Source: verl's ``rollout_corr_helper.py`` (volcengine/verl#3984, "Rollout Correction for General
Off-Policy Problems").
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from lit_offpolicy.core.masked import masked_mean, masked_sum, zero_padding

SAFETY_BOUND = 20.0
"""Every exponentiated log ratio is clamped to [−20, 20] first: exp(±20) ≈ 4.9e8 / 2.1e-9 (as verl)."""

IS_LEVELS = ("token", "sequence")
RS_LEVELS = ("token", "sequence", "geometric")


def safe_exp(log_value: Tensor) -> Tensor:
    """exp(clamp(x, −20, 20)): finite in float32 and float64, and exactly 1 at x = 0."""
    return torch.exp(log_value.clamp(-SAFETY_BOUND, SAFETY_BOUND))


def level_log_ratio(log_ratio: Tensor, mask: Tensor, level: str) -> Tensor:
    """The log ratio each token is judged by, broadcast to (batch, T):

    - ``token``:     r_t
    - ``sequence``:  Σ_{s valid} r_s        (log of the product of the token ratios)
    - ``geometric``: (1/|o|) Σ_{s valid} r_s (log of their geometric mean; 0 for an empty row)
    """
    if level == "token":
        return zero_padding(log_ratio, mask)
    per_sequence = (
        masked_sum(log_ratio, mask, dim=-1) if level == "sequence" else masked_mean(log_ratio, mask, -1)
    )
    return per_sequence.unsqueeze(-1).expand_as(log_ratio)


def level_ratio(log_ratio: Tensor, mask: Tensor, level: str) -> Tensor:
    """ρ at ``level`` (see :func:`level_log_ratio`), exponentiated with :func:`safe_exp`; 0 on padding."""
    return zero_padding(safe_exp(level_log_ratio(log_ratio, mask, level)), mask)


def truncated_is_weights(ratio: Tensor, mask: Tensor, threshold: float) -> Tensor:
    """Truncated importance weights w = min(ρ, C) on valid tokens, 0 on padding (TIS, Yao et al. 2025)."""
    return zero_padding(ratio.clamp(max=threshold), mask)


def rejection_keep(ratio: Tensor, mask: Tensor, lower: float, upper: float) -> Tensor:
    """Boolean (batch, T): valid tokens whose ρ lies in [lower, upper].

    With a sequence-level ρ every token of a row shares the verdict, so whole sequences go.
    """
    return mask & (ratio >= lower) & (ratio <= upper)


def veto_keep(log_ratio: Tensor, mask: Tensor, veto_threshold: float) -> Tensor:
    """Boolean (batch, 1): False for a row holding any valid token with r_t < log(veto_threshold).

    Compared in log space on the unclamped r_t, so a threshold below exp(−20) still works.
    """
    catastrophic = mask & (zero_padding(log_ratio, mask) < math.log(veto_threshold))
    return ~catastrophic.any(dim=-1, keepdim=True)
