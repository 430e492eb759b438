"""Pure IS: off-policy REINFORCE with a truncated importance weight and no PPO clipping.

The loss of the ``pure_is`` mode (bypass mode, π_old := π_rollout), following verl's
``compute_policy_loss_with_rollout_correction`` (volcengine/verl#3984):

    L_t = −A_t · w_t · log π_θ(y_t),   w = sg(min(ρ, C)),   ρ = π_θ / π_rollout

at token level (ρ_t) or sequence level (Π_t ρ_t shared by the sequence's tokens), sg = stop-gradient.
Its gradient is −A_t · w_t · ∇ log π_θ(y_t): the importance-weighted policy gradient with samples
drawn from π_rollout. Without ``rollout_is`` the weight is 1 (plain REINFORCE).
"""

from __future__ import annotations

import torch
from torch import Tensor

from lit_offpolicy.core.checks import check_choice, check_range, check_same_shape
from lit_offpolicy.core.masked import masked_mean, zero_padding
from lit_offpolicy.correction.ratios import IS_LEVELS, level_ratio, truncated_is_weights
from lit_offpolicy.losses import LOSS_AGG_MODES, PolicyLossOutput, aggregate


def pure_is_policy_loss(
    *,
    log_probs: Tensor,
    rollout_log_probs: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    rollout_is: str | None = "sequence",
    threshold: float = 2.0,
    loss_agg_mode: str = "token-mean",
) -> PolicyLossOutput:
    """The pure-IS policy loss, aggregated with ``loss_agg_mode`` over ``response_mask``.

    (batch, T) tensors; only ``log_probs`` carries gradient, padding may hold anything. Pass the
    mask returned by :meth:`RolloutCorrection.compute` and the correction's ``rollout_is`` and
    ``rollout_is_threshold``. Metrics (python floats, no namespace): ``pg_loss``,
    ``is_weight_mean`` (mean w), ``is_truncated_fraction`` (fraction of tokens with ρ > C) and
    ``policy_kl`` (mean of log π_rollout − log π_θ), over valid tokens.
    """
    check_choice("rollout_is", rollout_is, (None, *IS_LEVELS))
    check_range("threshold", threshold, low=0.0, low_inclusive=False)
    check_choice("loss_agg_mode", loss_agg_mode, LOSS_AGG_MODES)
    check_same_shape(
        log_probs=log_probs,
        rollout_log_probs=rollout_log_probs,
        advantages=advantages,
        response_mask=response_mask,
    )
    mask = response_mask.bool()
    log_probs = zero_padding(log_probs, mask)
    advantages = zero_padding(advantages.detach().to(log_probs.dtype), mask)
    log_ratio = zero_padding(log_probs.detach() - rollout_log_probs.detach().to(log_probs.dtype), mask)
    if rollout_is is None:
        weights, truncated = mask.to(log_probs.dtype), torch.zeros_like(mask)
    else:
        ratio = level_ratio(log_ratio, mask, rollout_is)
        weights, truncated = truncated_is_weights(ratio, mask, threshold), ratio > threshold
    loss = aggregate(-advantages * weights * log_probs, mask, loss_agg_mode)
    with torch.no_grad():
        metric_tensors = {
            "pg_loss": loss,
            "is_weight_mean": masked_mean(weights, mask),
            "is_truncated_fraction": masked_mean(truncated.to(log_probs.dtype), mask),
            "policy_kl": masked_mean(-log_ratio, mask),
        }
        metrics = {name: float(value) for name, value in metric_tensors.items()}
    return PolicyLossOutput(loss=loss, metrics=metrics)
