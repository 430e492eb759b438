"""Advantage estimators: token-level rewards (and critic values or prompt groups) to (advantages, returns).

Every estimator is called as ``est(token_level_rewards, response_mask, values=None, group_ids=None)`` on
(batch, response_len) tensors with a right-padded 0/1 ``response_mask`` (a row may be all padding).
Padding may hold anything, NaN included: it is zeroed before use and is exactly 0 in both outputs.
Multi-turn episodes add ``action_mask`` (1 on the tokens the policy sampled, holes where an
environment's observations sit): the estimator then runs on each row's policy tokens moved together,
as one response (observation tokens skipped: for GAE, δ_t = r_t + γ V_{t'} − V_t with t' the next
policy token, and A_t = δ_t + γλ A_{t'}), and observation tokens get advantage and return 0.
Outputs have the rewards' shape and dtype (bfloat16/float16 are computed in float32, float64 stays
float64, non-floating rewards give float32) and never require grad.
"""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import Tensor

from lit_offpolicy.advantages.shaping import (
    GroupIds,
    check_action_mask,
    check_right_padded,
    group_deviation,
    group_index,
    result_dtype,
    working_dtype,
)
from lit_offpolicy.core.checks import check_choice, check_range, check_same_shape
from lit_offpolicy.core.masked import compaction_order, expand_compacted, masked_whiten, zero_padding
from lit_offpolicy.core.registry import Registry

GROUP_STD_EPS = 1e-6


def discounted_returns(rewards: Tensor, gamma: float) -> Tensor:
    """G_t = r_t + γ G_{t+1}, scanned right to left (rewards must already be 0 on padding)."""
    returns = torch.zeros_like(rewards)
    running = rewards.new_zeros(rewards.shape[0])
    for t in reversed(range(rewards.shape[1])):
        running = rewards[:, t] + gamma * running
        returns[:, t] = running
    return returns


class Advantage:
    """Base class: validates the inputs, zeroes the padding, runs :meth:`estimate` without grad."""

    needs_values: ClassVar[bool] = False
    """The estimator needs the critic's ``values``."""
    needs_groups: ClassVar[bool] = False
    """It needs ``group_ids``: one hashable id per sample, equal for the samples of one prompt."""

    def __call__(
        self,
        token_level_rewards: Tensor,
        response_mask: Tensor,
        values: Tensor | None = None,
        group_ids: GroupIds | None = None,
        action_mask: Tensor | None = None,
    ) -> tuple[Tensor, Tensor]:
        check_same_shape(token_level_rewards=token_level_rewards, response_mask=response_mask, values=values)
        name = type(self).__name__
        if token_level_rewards.dim() != 2:
            raise ValueError(
                f"token_level_rewards has shape {list(token_level_rewards.shape)}; "
                "allowed values: (batch, response_len)"
            )
        if self.needs_values and values is None:
            raise ValueError(
                f"{name} needs critic values: got values=None; pass values of shape (batch, response_len)"
            )
        if self.needs_groups and group_ids is None:
            raise ValueError(f"{name} needs prompt groups: got group_ids=None; pass one id per sample")
        device = token_level_rewards.device
        mask = response_mask.to(device).bool()
        check_right_padded(mask)
        order = None
        if action_mask is not None:  # the policy's tokens moved to the front of each row
            mask = check_action_mask(action_mask, mask)
            order = compaction_order(mask)
            mask = mask.gather(1, order)
        dtype = working_dtype(token_level_rewards)
        groups = group_index(group_ids, len(mask), device) if self.needs_groups else None
        with torch.no_grad():
            rewards, values = (
                token_level_rewards.to(dtype),
                None if values is None else values.to(device, dtype),
            )
            if order is not None:
                rewards = rewards.gather(1, order)
                values = None if values is None else values.gather(1, order)
            rewards = zero_padding(rewards, mask)
            if values is not None:
                values = zero_padding(values, mask)
            advantages, returns = self.estimate(rewards, mask, values, groups)
            out = result_dtype(token_level_rewards)
            advantages, returns = zero_padding(advantages, mask).to(out), zero_padding(returns, mask).to(out)
            if order is None:
                return advantages, returns
            return expand_compacted(advantages, order), expand_compacted(returns, order)

    def estimate(
        self, rewards: Tensor, mask: Tensor, values: Tensor | None, groups: Tensor | None
    ) -> tuple[Tensor, Tensor]:
        """(advantages, returns) from padding-free ``rewards``/``values``, the bool ``mask`` and the
        dense group number of each sample (``groups``, when ``needs_groups``)."""
        raise NotImplementedError


ADVANTAGES: Registry[type[Advantage]] = Registry("advantage", Advantage)
"""Short names of the advantage estimators (``@ADVANTAGES.register("name")`` on the class)."""


@ADVANTAGES.register("gae")
class GAE(Advantage):
    """Generalized Advantage Estimation (Schulman et al. 2016, arXiv:1506.02438; ROLL/verl ``gae``).

    δ_t = r_t + γ V_{t+1} − V_t with V = 0 after the last valid token; A_t = δ_t + γλ A_{t+1};
    returns = A + V.
    """

    needs_values = True

    def __init__(self, gamma: float = 1.0, lambd: float = 0.95) -> None:
        self.gamma = check_range("gamma", gamma, low=0.0, high=1.0)
        self.lambd = check_range("lambd", lambd, low=0.0, high=1.0)

    def estimate(self, rewards, mask, values, groups):
        advantages = torch.zeros_like(rewards)
        next_value = rewards.new_zeros(rewards.shape[0])
        next_advantage = rewards.new_zeros(rewards.shape[0])
        for t in reversed(range(rewards.shape[1])):
            delta = rewards[:, t] + self.gamma * next_value - values[:, t]
            next_advantage = delta + self.gamma * self.lambd * next_advantage
            advantages[:, t] = next_advantage
            next_value = values[:, t]
        return advantages, advantages + values


@ADVANTAGES.register("reinforce")
class Reinforce(Advantage):
    """REINFORCE return-to-go (Williams 1992; ROLL ``adv_estimator: reinforce``).

    A_t = G_t = Σ_{k≥t} γ^{k−t} r_k over valid tokens; returns = advantages.
    """

    def __init__(self, gamma: float = 1.0) -> None:
        self.gamma = check_range("gamma", gamma, low=0.0, high=1.0)

    def estimate(self, rewards, mask, values, groups):
        returns = discounted_returns(rewards, self.gamma)
        return returns, returns


@ADVANTAGES.register("grpo")
class GRPO(Advantage):
    """Group-relative outcome advantage (Shao et al. 2024, DeepSeekMath; verl ``grpo``).

    s = Σ_t r_t over valid tokens; A = (s − mean_g) / (std_g + 1e-6), or s − mean_g without
    ``norm_by_std`` (Dr. GRPO); std is unbiased; every valid token gets A; returns = advantages.
    A group with a single sample has mean 0 and std 1 (A = s / (1 + 1e-6), as verl). Samples with an
    empty response do not enter their group's statistics (verl counts them with s = 0).
    """

    needs_groups = True

    def __init__(self, norm_by_std: bool = True) -> None:
        self.norm_by_std = check_choice("norm_by_std", norm_by_std, (True, False))

    def estimate(self, rewards, mask, values, groups):
        deviation, std, _ = group_deviation(rewards.sum(dim=1), groups, counted=mask.any(dim=1))
        advantage = deviation / (std + GROUP_STD_EPS) if self.norm_by_std else deviation
        advantages = advantage[:, None].expand_as(rewards)
        return advantages, advantages


@ADVANTAGES.register("rloo")
class RLOO(Advantage):
    """REINFORCE leave-one-out (Kool et al. 2019; Ahmadian et al. 2024; verl ``rloo``).

    s = Σ_t r_t over valid tokens; A_i = s_i − mean_{j≠i} s_j = n/(n−1) (s_i − mean_g) for a group of
    n samples; every valid token gets A; returns = advantages. A group with a single sample has no
    baseline and gets A = 0 (verl leaves its score instead). Samples with an empty response do not
    enter their group.
    """

    needs_groups = True

    def estimate(self, rewards, mask, values, groups):
        deviation, _, count = group_deviation(rewards.sum(dim=1), groups, counted=mask.any(dim=1))
        advantage = torch.where(count > 1, deviation * count / (count - 1).clamp(min=1), 0.0)
        advantages = advantage[:, None].expand_as(rewards)
        return advantages, advantages


@ADVANTAGES.register("reinforce++")
class ReinforcePlusPlus(Advantage):
    """REINFORCE++ (Hu 2025, arXiv:2501.03262; verl ``reinforce_plus_plus``).

    G_t = Σ_{k≥t} γ^{k−t} r_k over valid tokens; A = whiten(G) over the batch's valid tokens
    (unbiased var, eps 1e-8); returns = G (not whitened).
    """

    def __init__(self, gamma: float = 1.0) -> None:
        self.gamma = check_range("gamma", gamma, low=0.0, high=1.0)

    def estimate(self, rewards, mask, values, groups):
        returns = discounted_returns(rewards, self.gamma)
        return masked_whiten(returns, mask), returns
