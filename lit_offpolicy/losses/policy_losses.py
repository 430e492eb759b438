"""The policy losses of ROLL's off-policy algorithms guide (``pg_variant``), and GSPO.

PPO, vanilla, TIS, TOPR, CISPO, Kimi-1.5; GSPO: the sequence-level ratio of Qwen3's RL loss.

Notation per valid token: A advantage, r = π_θ/π_old the importance ratio, sg(·) stop-gradient.
Every class returns the per-token loss; :class:`~lit_offpolicy.losses.base.PolicyLoss` aggregates.
"""

from __future__ import annotations

import torch
from torch import Tensor

from lit_offpolicy.core.checks import check_range
from lit_offpolicy.core.masked import masked_mean
from lit_offpolicy.losses.base import POLICY_LOSSES, PolicyInputs, PolicyLoss, masked_fraction


@POLICY_LOSSES.register("ppo")
class PPO(PolicyLoss):
    """Clipped surrogate (Schulman et al. 2017) with asymmetric clip and dual clip (Ye et al. 2020).

    L = max(−A·r, −A·clip(r, 1 − ε_low, 1 + ε_high)); with dual clip, for A < 0: L = min(L, −c·A).
    ε_low/ε_high default to ``pg_clip`` (ROLL's ``use_pg_clip_range`` is "either is set").
    ``dual_clip_c=None`` is ROLL's c = 1 + 2·pg_clip; ``dual_clip_c=3.0`` reproduces verl's default.
    """

    def __init__(
        self,
        pg_clip: float = 0.2,
        pg_clip_low: float | None = None,
        pg_clip_high: float | None = None,
        dual_clip_loss: bool = True,
        dual_clip_c: float | None = None,
        loss_agg_mode: str = "token-mean",
    ) -> None:
        super().__init__(loss_agg_mode)
        self.pg_clip = check_range("pg_clip", pg_clip, low=0.0, high=1.0, high_inclusive=False)
        low = pg_clip if pg_clip_low is None else pg_clip_low
        high = pg_clip if pg_clip_high is None else pg_clip_high
        self.pg_clip_low = check_range("pg_clip_low", low, low=0.0, high=1.0, high_inclusive=False)
        self.pg_clip_high = check_range("pg_clip_high", high, low=0.0)
        self.dual_clip_loss = dual_clip_loss
        c = 1.0 + 2.0 * pg_clip if dual_clip_c is None else dual_clip_c
        self.dual_clip_c = check_range("dual_clip_c", c, low=1.0, low_inclusive=False)

    def token_loss(self, x: PolicyInputs) -> tuple[Tensor, dict[str, Tensor]]:
        clipped_ratio = x.ratio.clamp(1.0 - self.pg_clip_low, 1.0 + self.pg_clip_high)
        unclipped_loss = -x.advantages * x.ratio
        clipped_loss = -x.advantages * clipped_ratio
        loss = torch.maximum(unclipped_loss, clipped_loss)
        metrics = {
            "pg_clipfrac": masked_fraction(clipped_loss > unclipped_loss, x.mask),
            "ppo_ratio_low_clipfrac": masked_fraction(x.ratio < 1.0 - self.pg_clip_low, x.mask),
            "ppo_ratio_high_clipfrac": masked_fraction(x.ratio > 1.0 + self.pg_clip_high, x.mask),
        }
        metrics["ppo_ratio_clipfrac"] = metrics["ppo_ratio_low_clipfrac"] + metrics["ppo_ratio_high_clipfrac"]
        if self.dual_clip_loss:
            dual_bound = -self.dual_clip_c * x.advantages
            dual_active = (x.advantages < 0) & (loss > dual_bound)
            loss = torch.where(dual_active, dual_bound, loss)
            metrics["dual_clipfrac"] = masked_fraction(dual_active, x.mask)
        return loss, metrics


@POLICY_LOSSES.register("vanilla")
class Vanilla(PolicyLoss):
    """REINFORCE: L = −A·log π_θ (ROLL's ``vanilla``)."""

    def token_loss(self, x: PolicyInputs) -> tuple[Tensor, dict[str, Tensor]]:
        return -x.advantages * x.log_probs, {}


@POLICY_LOSSES.register("tis")
class TIS(PolicyLoss):
    """Truncated importance sampling: L = −sg(clip(r, lower, upper))·A·log π_θ (ROLL's ``tis``)."""

    def __init__(self, lower_bound: float = 0.0, upper_bound: float = 1.0, loss_agg_mode: str = "token-mean"):
        super().__init__(loss_agg_mode)
        self.lower_bound = check_range("lower_bound", lower_bound, low=0.0)
        self.upper_bound = check_range("upper_bound", upper_bound, low=self.lower_bound, low_inclusive=False)

    def token_loss(self, x: PolicyInputs) -> tuple[Tensor, dict[str, Tensor]]:
        weight = x.ratio.clamp(self.lower_bound, self.upper_bound).detach()
        lower = masked_fraction(x.ratio < self.lower_bound, x.mask)
        upper = masked_fraction(x.ratio > self.upper_bound, x.mask)
        metrics = {
            "tis_lower_clipfrac": lower,
            "tis_upper_clipfrac": upper,
            "tis_total_clipfrac": lower + upper,
        }
        return -weight * x.advantages * x.log_probs, metrics


@POLICY_LOSSES.register("topr")
class TOPR(PolicyLoss):
    """Tapered off-policy REINFORCE (Le Roux et al. 2025, arXiv:2503.14286, eq. 8; ROLL's ``topr``).

    Positive samples (score > 0) get the plain log-likelihood update, negative ones (score ≤ 0)
    a truncated-IS update with the ratio clipped to [0, 1]:
    L = −w₊·A·log π_θ  (score > 0),   L = −w₋·sg(clip(r, 0, 1))·A·log π_θ  (score ≤ 0).
    """

    needs_scores = True

    def __init__(
        self, positive_weight: float = 1.0, negative_weight: float = 1.0, loss_agg_mode: str = "token-mean"
    ) -> None:
        super().__init__(loss_agg_mode)
        self.positive_weight = check_range("positive_weight", positive_weight, low=0.0)
        self.negative_weight = check_range("negative_weight", negative_weight, low=0.0)

    def token_loss(self, x: PolicyInputs) -> tuple[Tensor, dict[str, Tensor]]:
        positive = (x.scores > 0).unsqueeze(-1).expand_as(x.log_probs)
        weight = torch.where(
            positive,
            torch.full_like(x.ratio, self.positive_weight),
            self.negative_weight * x.ratio.clamp(0.0, 1.0).detach(),
        )
        negative_tokens = x.mask & ~positive
        valid_samples = x.mask.any(dim=-1)
        metrics = {
            "topr_positive_fraction": masked_fraction(x.scores > 0, valid_samples),
            "topr_negative_upper_clipfrac": masked_fraction(x.ratio > 1.0, negative_tokens),
        }
        return -weight * x.advantages * x.log_probs, metrics


@POLICY_LOSSES.register("cispo")
class CISPO(PolicyLoss):
    """Clipped IS-weight policy optimization (MiniMax-M1, arXiv:2506.13585; ROLL's ``cispo``).

    L = −sg(clip(r, 1 − ε_low, 1 + ε_high))·A·log π_θ. With ``use_unified_mask`` (paper eq. 7) the
    tokens PPO would clip away are dropped: A > 0 with r > 1 + ε_high, or A < 0 with r < 1 − ε_low.
    """

    def __init__(
        self,
        epsilon_low: float = 0.1,
        epsilon_high: float = 0.1,
        use_unified_mask: bool = False,
        loss_agg_mode: str = "token-mean",
    ) -> None:
        super().__init__(loss_agg_mode)
        self.epsilon_low = check_range("epsilon_low", epsilon_low, low=0.0, high=1.0, high_inclusive=False)
        self.epsilon_high = check_range("epsilon_high", epsilon_high, low=0.0)
        self.use_unified_mask = use_unified_mask

    def token_loss(self, x: PolicyInputs) -> tuple[Tensor, dict[str, Tensor]]:
        lower, upper = 1.0 - self.epsilon_low, 1.0 + self.epsilon_high
        weight = x.ratio.clamp(lower, upper).detach()
        loss = -weight * x.advantages * x.log_probs
        below, above = x.ratio < lower, x.ratio > upper
        metrics = {
            "cispo_lower_clipfrac": masked_fraction(below, x.mask),
            "cispo_upper_clipfrac": masked_fraction(above, x.mask),
            "cispo_total_clipfrac": masked_fraction(below | above, x.mask),
        }
        if self.use_unified_mask:
            dropped = ((x.advantages > 0) & above) | ((x.advantages < 0) & below)
            loss = torch.where(dropped, torch.zeros_like(loss), loss)
            metrics["cispo_masked_fraction"] = masked_fraction(dropped, x.mask)
        return loss, metrics


@POLICY_LOSSES.register("kimi15")
class Kimi15(PolicyLoss):
    """Kimi k1.5 (arXiv:2501.12599, eq. 3; ROLL's ``kimi15``): L = −A·log π_θ + τ/2·(log π_θ − log π_old)²."""

    def __init__(self, tau: float = 0.1, loss_agg_mode: str = "token-mean") -> None:
        super().__init__(loss_agg_mode)
        self.tau = check_range("tau", tau, low=0.0)

    def token_loss(self, x: PolicyInputs) -> tuple[Tensor, dict[str, Tensor]]:
        drift = x.log_probs - x.old_log_probs
        penalty = 0.5 * self.tau * drift**2
        return -x.advantages * x.log_probs + penalty, {
            "kimi15_penalty": masked_mean(penalty.detach(), x.mask)
        }


@POLICY_LOSSES.register("gspo")
class GSPO(PolicyLoss):
    """Group Sequence Policy Optimization, token form (Zheng et al. 2025, arXiv:2507.18071, eqs. 5–7 and 10).

    One ratio per response, the geometric mean of its token ratios, s_i = exp((1/|y_i|) Σ_t log r_it),
    and on each token that value with the token's own gradient:
    log s_it = sg(log s_i) + log π_θ(y_it) − sg(log π_θ(y_it)), clipped as PPO:
    L_it = max(−A_it·s_it, −A_it·clip(s_it, 1 − ε_low, 1 + ε_high)) (no dual clip).
    With one advantage per response and ``seq-mean-token-mean`` (the paper's 1/|y_i| per response,
    the default) the gradient is GSPO's sequence-level one, s_i·A_i·(1/|y_i|) Σ_t ∇log π_θ(y_it).
    ε_low/ε_high fall back to ``pg_clip`` and, where that is None too, to the paper's 3e-4 / 4e-4
    (section 5.1): sequence ratios stay far closer to 1 than token ratios.
    """

    def __init__(
        self,
        pg_clip: float | None = None,
        pg_clip_low: float | None = None,
        pg_clip_high: float | None = None,
        loss_agg_mode: str = "seq-mean-token-mean",
    ) -> None:
        super().__init__(loss_agg_mode)
        if pg_clip is not None:
            check_range("pg_clip", pg_clip, low=0.0, high=1.0, high_inclusive=False)
        low = pg_clip_low if pg_clip_low is not None else pg_clip if pg_clip is not None else 3e-4
        high = pg_clip_high if pg_clip_high is not None else pg_clip if pg_clip is not None else 4e-4
        self.pg_clip = pg_clip
        self.pg_clip_low = check_range("pg_clip_low", low, low=0.0, high=1.0, high_inclusive=False)
        self.pg_clip_high = check_range("pg_clip_high", high, low=0.0)

    def token_loss(self, x: PolicyInputs) -> tuple[Tensor, dict[str, Tensor]]:
        seq_log_ratio = masked_mean(x.log_ratio.detach(), x.mask, dim=-1)  # log s_i; 0 for an empty row
        ratio = torch.exp(seq_log_ratio[:, None] + x.log_probs - x.log_probs.detach())  # value s_i
        clipped_ratio = ratio.clamp(1.0 - self.pg_clip_low, 1.0 + self.pg_clip_high)
        unclipped_loss = -x.advantages * ratio
        clipped_loss = -x.advantages * clipped_ratio
        responses = x.mask.any(dim=-1)
        seq_ratio = torch.exp(seq_log_ratio)
        metrics = {
            "pg_clipfrac": masked_fraction(clipped_loss > unclipped_loss, x.mask),
            "gspo_seq_ratio_mean": masked_mean(seq_ratio, responses),
            "gspo_seq_ratio_low_clipfrac": masked_fraction(seq_ratio < 1.0 - self.pg_clip_low, responses),
            "gspo_seq_ratio_high_clipfrac": masked_fraction(seq_ratio > 1.0 + self.pg_clip_high, responses),
        }
        return torch.maximum(unclipped_loss, clipped_loss), metrics
