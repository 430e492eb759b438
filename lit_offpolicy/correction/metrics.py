"""Off-policy diagnostics between π_old and π_rollout, and statistics of the IS weights.

All functions return 0-d tensors keyed by the metric's name without the ``rollout_corr/`` prefix.
A mean over an empty set (no valid token, no non-empty sequence) is 0, as in ``masked_mean``.
Definitions follow verl's ``compute_offpolicy_metrics`` / ``compute_is_metrics``
(volcengine/verl#3984); where they differ, the docstring says so.
"""

from __future__ import annotations

import torch
from torch import Tensor

from lit_offpolicy.core.masked import masked_count, masked_mean, masked_sum, masked_var, zero_padding
from lit_offpolicy.correction.ratios import safe_exp


def sequence_mean(per_sequence: Tensor, nonempty: Tensor) -> Tensor:
    """Mean of a (batch,) tensor over the sequences with at least one valid token."""
    return masked_mean(per_sequence, nonempty)


def offpolicy_metrics(old_log_probs: Tensor, rollout_log_probs: Tensor, mask: Tensor) -> dict[str, Tensor]:
    """KL, perplexity and χ² diagnostics of the π_old / π_rollout gap.

    With r_t = log π_old − log π_rollout on valid tokens, ρ_t = exp(r_t), per sequence i the means
    m_old,i and m_roll,i of its log-probs and its log ratio R_i = Σ_t r_t:

    - ``kl``           = mean_t(log π_rollout − log π_old)        k1 estimate of KL(π_rollout ‖ π_old)
    - ``k3_kl``        = mean_t(ρ_t − r_t − 1)                    k3 estimate of the same KL, ≥ 0
    - ``training_ppl`` = mean_i exp(−m_old,i)                     ``rollout_ppl`` likewise with m_roll,i
    - ``log_ppl_diff`` = mean_i (m_roll,i − m_old,i)              = mean_i log(training_ppl_i / rollout_ppl_i)
    - ``ppl_ratio``    = mean_i exp(m_roll,i − m_old,i)           = mean_i training_ppl_i / rollout_ppl_i
    - ``chi2_token``   = mean_t(ρ_t²) − 1                         χ²(π_old ‖ π_rollout) per token
    - ``chi2_seq``     = mean_i(exp(2 R_i)) − 1                   χ² of whole sequences

    Token means run over valid tokens, sequence means over non-empty sequences (verl averages
    ``chi2_seq`` and the perplexities over every row, empty ones included). Exponentiated log
    ratios are clamped to ±20 first; perplexities are not.
    """
    log_ratio = zero_padding(old_log_probs - rollout_log_probs, mask)
    nonempty = mask.any(dim=-1)
    old_mean = masked_mean(old_log_probs, mask, dim=-1)
    rollout_mean = masked_mean(rollout_log_probs, mask, dim=-1)
    log_ppl_diff = rollout_mean - old_mean
    token_ratio = safe_exp(log_ratio)
    sequence_ratio = safe_exp(masked_sum(log_ratio, mask, dim=-1))
    return {
        "kl": masked_mean(-log_ratio, mask),
        "k3_kl": masked_mean(token_ratio - log_ratio - 1, mask),
        "training_ppl": sequence_mean(torch.exp(-old_mean), nonempty),
        "rollout_ppl": sequence_mean(torch.exp(-rollout_mean), nonempty),
        "log_ppl_diff": sequence_mean(log_ppl_diff, nonempty),
        "ppl_ratio": sequence_mean(safe_exp(log_ppl_diff), nonempty),
        "chi2_token": masked_mean(token_ratio.square() - 1, mask),
        "chi2_seq": sequence_mean(sequence_ratio.square() - 1, nonempty),
    }


def is_weight_metrics(ratio: Tensor, weights: Tensor, mask: Tensor, threshold: float) -> dict[str, Tensor]:
    """Statistics of the truncated weights w = min(ρ, C) over valid tokens (N of them).

    - ``rollout_is_mean`` / ``_std`` / ``_min`` / ``_max``: of w (std without Bessel's correction)
    - ``rollout_is_eff_sample_size`` = (Σ w)² / (N · Σ w²), in (0, 1]; 1 when all weights are equal
      (Kish's effective sample size divided by N; verl's 1 / mean((w / mean w)²) is the same number)
    - ``rollout_is_ratio_fraction_high`` / ``_low``: fraction of tokens with ρ > C / ρ < 1/C, ρ
      before truncation

    A sequence-level weight counts once per valid token of its sequence.
    """
    count = masked_count(mask).to(weights.dtype)
    has_tokens = count > 0
    weight_sum = masked_sum(weights, mask)
    squared_sum = masked_sum(weights.square(), mask)
    tiny = torch.finfo(weights.dtype).tiny
    ess = torch.where(has_tokens, weight_sum.square() / (count * squared_sum).clamp(min=tiny), 0.0)
    zero = weights.new_zeros(())
    largest = torch.where(mask, weights, -torch.inf).amax() if mask.numel() else zero
    smallest = torch.where(mask, weights, torch.inf).amin() if mask.numel() else zero
    return {
        "rollout_is_mean": masked_mean(weights, mask),
        "rollout_is_std": masked_var(weights, mask, unbiased=False).sqrt(),
        "rollout_is_min": torch.where(has_tokens, smallest, zero),
        "rollout_is_max": torch.where(has_tokens, largest, zero),
        "rollout_is_eff_sample_size": ess,
        "rollout_is_ratio_fraction_high": masked_mean((ratio > threshold).to(weights.dtype), mask),
        "rollout_is_ratio_fraction_low": masked_mean((ratio < 1.0 / threshold).to(weights.dtype), mask),
    }
