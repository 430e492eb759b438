"""The PolicyLoss interface: per-token policy-gradient losses, masked, weighted and aggregated."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

from lit_offpolicy.core.checks import check_choice, check_same_shape
from lit_offpolicy.core.masked import masked_mean, zero_padding
from lit_offpolicy.core.registry import Registry
from lit_offpolicy.losses.aggregation import LOSS_AGG_MODES, aggregate

LOG_RATIO_CLAMP = 20.0


@dataclass
class PolicyLossOutput:
    """A policy loss and its metrics."""

    loss: Tensor
    """The differentiable scalar loss."""
    metrics: dict[str, Tensor | float]
    """Detached 0-dim tensors (or floats) named without namespace, left on the loss's device: the
    module reads them once per step (``MetricMeans``)."""


@dataclass
class PolicyInputs:
    """What a variant's ``token_loss`` sees, for B samples of T response tokens; padding is already
    zeroed in every tensor."""

    log_probs: Tensor
    """[B, T]: log π_θ, with gradient."""
    old_log_probs: Tensor
    """[B, T]: log π_old, no gradient."""
    log_ratio: Tensor
    """[B, T]: log π_θ − log π_old, clamped to ±``LOG_RATIO_CLAMP`` (as verl)."""
    ratio: Tensor
    """[B, T]: exp(log_ratio)."""
    advantages: Tensor
    """[B, T]: no gradient."""
    mask: Tensor
    """[B, T]: 1 on the tokens the loss counts."""
    scores: Tensor | None
    """[B]: each sample's score (TOPR), no gradient; None where the variant needs none."""


class PolicyLoss:
    """Base class of the policy losses (ROLL's off-policy algorithms guide: ``pg_variant``).

    Call with keyword arguments (batch, T) tensors; ``scores`` is the per-sample score (batch,) that
    TOPR needs; ``is_weights`` (rollout-correction importance weights, detached) multiply the
    per-token loss before aggregation. Tokens outside ``response_mask`` never affect the loss,
    its gradient or its metrics, whatever they hold.

    Subclasses implement :meth:`token_loss`, returning the per-token loss matrix and its metrics.
    """

    needs_scores: ClassVar[bool] = False
    """Whether :meth:`token_loss` reads ``scores`` (TOPR)."""

    def __init__(self, loss_agg_mode: str = "token-mean") -> None:
        self.loss_agg_mode = check_choice("loss_agg_mode", loss_agg_mode, LOSS_AGG_MODES)

    def token_loss(self, x: PolicyInputs) -> tuple[Tensor, dict[str, Tensor]]:
        raise NotImplementedError

    def __call__(
        self,
        *,
        log_probs: Tensor,
        old_log_probs: Tensor,
        advantages: Tensor,
        response_mask: Tensor,
        scores: Tensor | None = None,
        is_weights: Tensor | None = None,
    ) -> PolicyLossOutput:
        check_same_shape(
            log_probs=log_probs,
            old_log_probs=old_log_probs,
            advantages=advantages,
            response_mask=response_mask,
            is_weights=is_weights,
        )
        if self.needs_scores:
            scores = _checked_scores(type(self).__name__, scores, batch_size=log_probs.shape[0])
        mask = response_mask.bool()
        log_probs = zero_padding(log_probs, mask)
        old_log_probs = zero_padding(old_log_probs.detach(), mask)
        log_ratio = (log_probs - old_log_probs).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
        inputs = PolicyInputs(
            log_probs=log_probs,
            old_log_probs=old_log_probs,
            log_ratio=log_ratio,
            ratio=torch.exp(log_ratio),
            advantages=zero_padding(advantages.detach().to(log_probs.dtype), mask),
            mask=mask,
            scores=None if scores is None else scores.detach().to(log_probs.dtype),
        )
        loss_mat, metric_tensors = self.token_loss(inputs)
        if is_weights is not None:
            loss_mat = loss_mat * zero_padding(is_weights.detach().to(loss_mat.dtype), mask)
        loss = aggregate(loss_mat, mask, self.loss_agg_mode)
        with torch.no_grad():
            metric_tensors = {**metric_tensors, **ratio_metrics(inputs), "pg_loss": loss}
            metrics = {name: torch.as_tensor(value).detach() for name, value in metric_tensors.items()}
        return PolicyLossOutput(loss=loss, metrics=metrics)


POLICY_LOSSES: Registry[type[PolicyLoss]] = Registry("policy_loss", PolicyLoss)
"""Short names of the policy losses (``@POLICY_LOSSES.register("name")`` on the class)."""


def masked_fraction(condition: Tensor, mask: Tensor) -> Tensor:
    """Fraction of valid tokens where ``condition`` holds."""
    return masked_mean(condition.float(), mask)


def ratio_metrics(x: PolicyInputs) -> dict[str, Tensor]:
    """Ratio statistics over valid tokens, and two estimates of the π_old→π_θ drift.

    ``approx_kl`` = mean ½(log π_θ − log π_old)² (k2), ``policy_kl`` = mean (log π_old − log π_θ) (k1),
    both token means, as ROLL's ``approxkl`` / ``policykl``. Min/max are left out of an empty batch.
    """
    log_ratio = x.log_ratio.detach()
    metrics = {
        "ratio_mean": masked_mean(x.ratio.detach(), x.mask),
        "approx_kl": masked_mean(0.5 * log_ratio**2, x.mask),
        "policy_kl": masked_mean(-log_ratio, x.mask),
    }
    valid = x.ratio.detach()[x.mask]
    if valid.numel() > 0:
        metrics["ratio_max"] = valid.max()
        metrics["ratio_min"] = valid.min()
    return metrics


def _checked_scores(loss_name: str, scores: Tensor | None, batch_size: int) -> Tensor:
    if scores is None:
        raise ValueError(
            f"{loss_name} needs scores: pass scores=<tensor (batch,)> with each sample's reward "
            "(positive samples are those with score > 0)"
        )
    if scores.dim() != 1 or scores.shape[0] != batch_size:
        raise ValueError(f"scores must have shape ({batch_size},), got {list(scores.shape)}")
    return scores
