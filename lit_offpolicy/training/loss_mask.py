"""The tokens the policy loss counts and their weights: rollout correction and DAPO's overlong filtering."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from lit_offpolicy.core.experience import Experience
from lit_offpolicy.correction import RolloutCorrection


def truncated_responses(exp: Experience, mask_truncated: bool) -> Tensor | None:
    """(B,) bool, True where the engine cut the response at its max tokens (finish reason "length"),
    for DAPO's overlong filtering (Yu et al. 2025, arXiv:2503.14476, section 3.4); None when
    ``mask_truncated`` is off. An experience without finish reasons is an error."""
    if not mask_truncated:
        return None
    if exp.truncated is None:
        raise ValueError(
            "reward_shaping.mask_truncated=True needs each response's finish reason "
            "(Experience.truncated, which Experience.from_generations records); this experience has none"
        )
    return exp.truncated.to(exp.response_mask.device)


def without_truncated(mask: Tensor, truncated: Tensor | None) -> Tensor:
    """(B, R) ``mask`` with the rows of the ``truncated`` responses zeroed; ``mask`` itself for None."""
    if truncated is None:
        return mask
    return torch.where(truncated[:, None], torch.zeros_like(mask), mask)


@dataclass(frozen=True)
class LossMask:
    """Where and how much each token of B samples with R response tokens counts in the policy loss."""

    loss_mask: Tensor
    """(B, R) the policy's tokens, less those rejected or vetoed by the correction, less the rows of
    truncated responses (with ``mask_truncated``)."""
    is_weights: Tensor | None
    """(B, R) the correction's detached importance weights; None without ``rollout_is`` (or π_old)."""
    metrics: dict[str, float]
    """The correction's ``rollout_corr/*`` diagnostics; empty without π_old."""


def loss_mask(
    exp: Experience, old_log_probs: Tensor | None, correction: RolloutCorrection, truncated: Tensor | None
) -> LossMask:
    """Rollout correction of π_old against π_rollout over the policy's tokens (π_rollout exists only
    there), then the truncated responses left out (``truncated``, from ``truncated_responses``).

    With r_t = log π_old(y_t) − log π_rollout(y_t), the correction's weights min(exp(r), C) and its
    rejection follow verl's rollout correction (``RolloutCorrection``). ``old_log_probs`` None: π_old
    is not known yet (``OldLogProbs.UPDATE``), so the mask is the policy's tokens, with no weights
    and no diagnostics; the update then calls this again with π_old read off its forward.
    """
    if old_log_probs is None:
        return LossMask(loss_mask=without_truncated(exp.policy_mask, truncated), is_weights=None, metrics={})
    corrected = correction.compute(
        old_log_probs=old_log_probs, rollout_log_probs=exp.rollout_log_probs, response_mask=exp.policy_mask
    )
    return LossMask(
        loss_mask=without_truncated(corrected.response_mask, truncated),
        is_weights=corrected.is_weights,
        metrics=corrected.metrics,
    )
