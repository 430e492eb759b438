"""Reward and advantage shaping of a step's batch, over every rank's samples.

Batch-level statistics (reward normalization, the KL controller's observation, group advantages,
whitening) are computed over all ranks' samples, as one process holding the whole batch would;
each rank then keeps its own rows (``Batch.own``).
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from lit_offpolicy.advantages import (
    Advantage,
    RunningMoments,
    clip_advantages,
    clip_rewards,
    normalize_rewards,
    overlong_penalty,
    token_level_rewards,
    whiten_advantages,
)
from lit_offpolicy.core.distributed import gather_rows
from lit_offpolicy.core.experience import Experience
from lit_offpolicy.core.masked import masked_count, masked_mean
from lit_offpolicy.losses import kl_penalty
from lit_offpolicy.training.frozen import FrozenPasses
from lit_offpolicy.training.options import AdvantageShaping, KLOptions, RewardShaping


@dataclass(frozen=True)
class Batch:
    """Every rank's samples of the step, N in all, for the batch-level statistics; R' is the widest
    rank's response width (narrower rows are zero-filled, their mask 0 there)."""

    scores: Tensor
    """(N,) each sample's score from the reward function."""
    group_ids: Tensor
    """(N,) the prompt of each sample (its samples share an id)."""
    response_mask: Tensor
    """(N, R') 1 on the response tokens."""
    action_mask: Tensor | None
    """(N, R') 1 on the tokens the policy sampled, 0 on an environment's observations; None: all."""
    policy_mask: Tensor
    """(N, R') ``response_mask`` ∧ ``action_mask``: the tokens that are advantaged and trained on."""
    values: Tensor | None
    """(N, R') the critic's values; None without a critic."""
    kl: Tensor | None
    """(N, R') the per-token KL penalty k(π_old, π_ref) of the reward; None without ``kl.use_in_reward``."""
    mine: slice
    """This rank's rows."""
    width: int
    """R, this rank's response width (the Rollout callback's ``sampling.max_tokens``)."""

    def own(self, tensor: Tensor) -> Tensor:
        """(B, R): this rank's rows of an (N, R') tensor, at its own response width."""
        return tensor[self.mine, : self.width]


def gather_batch(exp: Experience, frozen: FrozenPasses, kl: KLOptions, group=None) -> Batch:
    """This rank's ``exp`` and its frozen passes joined with every other rank's (a collective), or with
    those of the ranks of ``group`` (sequence parallelism: one rank of each sequence group).

    With ``kl.use_in_reward`` the per-token penalty k(π_old, π_ref) of ``kl.penalty`` (Schulman 2020;
    verl ``use_kl_in_reward``, ROLL ``add_token_level_kl``) is computed here, on this rank's rows.
    """
    reward_kl = None
    if kl.use_in_reward:
        reward_kl = kl_penalty(frozen.old_log_probs, frozen.ref_log_probs, kl.penalty)
    (scores, group_ids, mask, action, values, reward_kl), mine = gather_rows(
        exp.scores, exp.group_ids, exp.response_mask, exp.action_mask, frozen.values, reward_kl, group=group
    )
    return Batch(
        scores=scores,
        group_ids=group_ids,
        response_mask=mask,
        action_mask=action,
        policy_mask=mask if action is None else mask * action,
        values=values,
        kl=reward_kl,
        mine=mine,
        width=exp.response_mask.shape[1],
    )


@dataclass(frozen=True)
class ShapedRewards:
    """The batch's token-level rewards and what shaping them measured."""

    rewards: Tensor
    """(N, R') the shaped score on each sample's last policy token, − β·KL on every policy token."""
    reward_kl: float | None
    """The in-reward KL's mean over the policy tokens (the KL controller's observation); None without."""
    metrics: dict[str, float]
    """``reward/overlong_penalty_mean``, ``actor/reward_kl`` and ``actor/kl_coef`` where they apply."""


def shape_rewards(
    batch: Batch, options: RewardShaping, running: RunningMoments, kl_coef: float
) -> ShapedRewards:
    """Scores to token-level rewards: r_t = clip(norm(s + p_overlong(|y|))) · 1[t = last] − β · KL_t.

    p_overlong: DAPO's soft overlong punishment (Yu et al. 2025, arXiv:2503.14476, eq. 13), with L_max
    the responses' width; norm and clip: ROLL's ``reward_norm`` / ``reward_shift`` / ``reward_scale``
    and ``reward_clip`` (clipping after normalization, as ROLL); − β · KL_t: ROLL's
    ``add_token_level_kl`` / verl's ``use_kl_in_reward``, β = ``kl_coef``. With
    ``options.norm == "running"`` ``running`` is updated with this batch's scores.
    """
    metrics: dict[str, float] = {}
    scores = batch.scores
    if options.overlong_buffer_length is not None:  # before normalization, as a reward term
        penalty = _overlong_penalty(masked_count(batch.response_mask, dim=-1), batch.width, options)
        scores = scores + penalty.to(scores.dtype)
        metrics["reward/overlong_penalty_mean"] = penalty.mean().item()
    scores = normalize_rewards(
        scores,
        reward_norm=options.norm,
        group_ids=batch.group_ids,
        running=running,
        reward_shift=options.shift,
        reward_scale=options.scale,
    )
    scores = clip_rewards(scores, options.clip)
    rewards = token_level_rewards(
        scores, batch.response_mask, kl=batch.kl, kl_coef=kl_coef, action_mask=batch.action_mask
    )
    reward_kl = None
    if batch.kl is not None:
        reward_kl = masked_mean(batch.kl, batch.policy_mask).item()
        metrics.update({"actor/reward_kl": reward_kl, "actor/kl_coef": kl_coef})
    return ShapedRewards(rewards=rewards, reward_kl=reward_kl, metrics=metrics)


def _overlong_penalty(lengths: Tensor, max_length: int, options: RewardShaping) -> Tensor:
    """(N,) DAPO's penalty of each response; L_max = ``max_length``, the width the rollout worker pads
    the responses to (``sampling.max_tokens``), which the buffer must stay below."""
    buffer_length = options.overlong_buffer_length
    if buffer_length >= max_length:
        raise ValueError(
            f"reward_shaping.overlong_buffer_length={buffer_length} must be smaller than the responses' "
            f"max length (the Rollout callback's sampling.max_tokens={max_length}); allowed values: "
            f"1..{max_length - 1}"
        )
    return overlong_penalty(lengths, max_length, buffer_length, options.overlong_penalty_factor)


@dataclass(frozen=True)
class ShapedAdvantages:
    """The batch's advantages and returns, after whitening and clipping."""

    advantages: Tensor
    """(N, R') Â_t of each token, 0 on padding."""
    returns: Tensor
    """(N, R') the value targets (Â_t + V_t for GAE)."""
    metrics: dict[str, float]
    """``actor/advantage_clipfrac`` (with clipping), ``actor/advantages_mean``, ``critic/returns_mean``
    (with a critic)."""


def estimate_advantages(
    estimator: Advantage, batch: Batch, rewards: Tensor, options: AdvantageShaping
) -> ShapedAdvantages:
    """The estimator's (Â, returns) from the token-level rewards, Â then whitened and clipped.

    Whitening: Â ← (Â − mean) / √(var + 1e-8) over the policy tokens (verl's ``masked_whiten``);
    clipping: Â ← clamp(Â, −c, c) (ROLL's ``advantage_clip``). Means are over the policy tokens.
    """
    metrics: dict[str, float] = {}
    advantages, returns = estimator(
        rewards,
        batch.response_mask,
        values=batch.values,
        group_ids=batch.group_ids,
        action_mask=batch.action_mask,
    )
    if options.whiten:
        advantages = whiten_advantages(advantages, batch.policy_mask)
    if options.clip is not None:
        advantages, clip_fraction = clip_advantages(advantages, batch.policy_mask, options.clip)
        metrics["actor/advantage_clipfrac"] = clip_fraction
    metrics["actor/advantages_mean"] = masked_mean(advantages, batch.policy_mask).item()
    if batch.values is not None:  # value targets: only a critic has them
        metrics["critic/returns_mean"] = masked_mean(returns, batch.policy_mask).item()
    return ShapedAdvantages(advantages=advantages, returns=returns, metrics=metrics)
