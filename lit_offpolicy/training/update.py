"""The update's pieces: the step's experience, its mini-batches and micro-batches, the loss of one
micro-batch and its share of the mini-batch's loss (exact accumulation), π_old back in sample order."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import Tensor

from lit_offpolicy.core.distributed import max_over_ranks
from lit_offpolicy.core.experience import Experience
from lit_offpolicy.core.masked import masked_mean
from lit_offpolicy.correction import RolloutCorrection, pure_is_policy_loss
from lit_offpolicy.losses import PolicyLoss, aggregate, kl_penalty, micro_batch_weight, value_loss
from lit_offpolicy.training.behaviour import loss_old_log_probs
from lit_offpolicy.training.forward import critic_values, policy_log_probs
from lit_offpolicy.training.micro_batches import by_prompt, by_size, by_token_budget, equalized
from lit_offpolicy.training.options import KLOptions, LossOptions, UpdateOptions
from lit_offpolicy.training.packing import sample_lengths
from lit_offpolicy.training.passes import Passes
from lit_offpolicy.training.shared_prefix import prompt_groups


def step_experience(batch: dict) -> Experience:
    """The rollouts a training batch carries under ``"experience"`` (the rollout callback puts them there)."""
    if "experience" not in batch:
        raise RuntimeError(
            "the training batch has no 'experience': OffPolicyModule trains on rollouts that a rollout "
            "callback adds to each batch; put lit_offpolicy.callbacks.Rollout in trainer.callbacks"
        )
    return batch["experience"]


def mini_batches(exp: Experience, options: UpdateOptions, seed: int) -> Iterator[Experience]:
    """``ppo_epochs`` passes over ``exp`` in mini-batches of ``mini_batch_size`` samples (one per
    optimizer step), each pass in its own random order (one generator seeded with ``seed`` for all
    passes); a single mini-batch keeps ``exp``'s order, which then changes nothing."""
    size = options.mini_batch_size or len(exp)
    shuffle = torch.Generator().manual_seed(seed) if size < len(exp) else None
    for _ in range(options.ppo_epochs):
        yield from exp.split(size, shuffle)


def micro_batch_groups(exp: Experience, options: UpdateOptions, device: torch.device) -> list[Tensor]:
    """The samples of ``exp`` in micro-batches, as groups of indices: ``micro_batch_size`` samples each,
    or at most ``max_tokens_per_micro_batch`` tokens each (first-fit decreasing), as many groups on every
    rank (a collective then, on ``device``), so that every rank makes as many forwards and backwards.
    Where the passes share prefixes (``UpdateOptions.shares_prefixes``) a prompt's samples go together
    (``by_prompt``; the budget counts each prompt once)."""
    budget, prompts = options.max_tokens_per_micro_batch, None
    if options.shares_prefixes:
        prompts = prompt_groups(exp)
    if budget is None:
        size = options.micro_batch_size
        return by_size(len(exp), size) if prompts is None else by_prompt(prompts, size)
    lengths = sample_lengths(exp).cpu()
    groups = by_token_budget(lengths, budget, prompts, exp.prompt_mask.sum(1).cpu())
    return equalized(groups, lengths, max_over_ranks(len(groups), device))


@dataclass(frozen=True)
class MicroBatchLoss:
    """The loss terms of a micro-batch of b samples with R response tokens."""

    actor: Tensor
    """() the actor's loss: rl_coef · policy loss + kl.loss_coef · KL − entropy_coef · entropy."""
    critic: Tensor | None
    """() the critic's value loss (token-mean over the policy's tokens); None without a critic."""
    metrics: dict[str, Tensor | float]
    """``actor/*`` (the policy loss's, ``kl_loss``, ``entropy``) and ``critic/*``, left on the device."""
    old_log_probs: Tensor | None
    """(b, R) π_θ.detach() of this forward where π_old is read off it (``OldLogProbs.UPDATE``); else None."""


def micro_batch_terms(
    micro: Experience,
    passes: Passes,
    policy_loss: PolicyLoss,
    correction: RolloutCorrection,
    weights: LossOptions,
    kl: KLOptions,
    old_from_update: bool,
) -> MicroBatchLoss:
    """The actor's loss (policy + KL − entropy bonus) and the critic's value loss of one micro-batch.

    L_actor = rl_coef · L_pg + kl.loss_coef · agg(k(π_θ, π_ref)) − entropy_coef · agg(H(π_θ)), each
    term aggregated over ``loss_mask`` in the policy loss's ``loss_agg_mode`` (the KL term as GRPO,
    Shao et al. 2024, arXiv:2402.03300); L_pg is off-policy REINFORCE (``pure_is_policy_loss``) with
    a pure-IS correction. The critic's loss is PPO's (clipped) value loss over the policy's tokens
    (``policy_mask``: every response token but an episode's observations, whose returns are 0).
    ``old_from_update``: π_old := π_θ.detach() of this forward, before the step's only optimizer step.
    """
    mask = micro.loss_mask
    with_entropy = weights.entropy_coef > 0
    log_probs, entropy = policy_log_probs(
        passes.actor,
        micro,
        micro.temperature,
        with_entropy,
        passes.chunk_size,
        passes.padding_free,
        passes.sequence,
        passes.shared_prefix,
    )
    read_off = log_probs.detach() if old_from_update else None
    old = micro.old_log_probs if read_off is None else read_off
    if correction.pure_is:
        pg = pure_is_policy_loss(
            log_probs=log_probs,
            rollout_log_probs=micro.rollout_log_probs,
            advantages=micro.advantages,
            response_mask=mask,
            rollout_is=correction.rollout_is,
            threshold=correction.rollout_is_threshold,
            loss_agg_mode=policy_loss.loss_agg_mode,
        )
    else:
        pg = policy_loss(
            log_probs=log_probs,
            old_log_probs=loss_old_log_probs(old, micro, passes.actor_version, correction),
            advantages=micro.advantages,
            response_mask=mask,
            scores=micro.scores,
            is_weights=micro.is_weights,
        )
    loss = weights.rl_coef * pg.loss
    metrics = {f"actor/{name}": value for name, value in pg.metrics.items()}
    mode = policy_loss.loss_agg_mode
    if kl.use_loss:
        kl_loss = aggregate(kl_penalty(log_probs, micro.ref_log_probs, kl.loss_type), mask, mode)
        loss = loss + kl.loss_coef * kl_loss
        metrics["actor/kl_loss"] = kl_loss.detach()
    if entropy is not None:
        entropy_loss = aggregate(entropy, mask, mode)
        loss = loss - weights.entropy_coef * entropy_loss
        metrics["actor/entropy"] = entropy_loss.detach()
    if passes.critic is None:
        return MicroBatchLoss(actor=loss, critic=None, metrics=metrics, old_log_probs=read_off)
    values = critic_values(passes.critic, micro, passes.padding_free, passes.sequence, passes.shared_prefix)
    critic_loss, vf_metrics = value_loss(
        values, micro.values, micro.returns, micro.policy_mask, weights.value_clip, loss_agg_mode="token-mean"
    )
    metrics.update({f"critic/{name}": value for name, value in vf_metrics.items()})
    metrics["critic/values_mean"] = masked_mean(values.detach(), micro.policy_mask)
    return MicroBatchLoss(actor=loss, critic=critic_loss, metrics=metrics, old_log_probs=read_off)


def accumulated_loss(
    actor_loss: Tensor,
    critic_loss: Tensor | None,
    micro: Experience,
    mini: Experience,
    loss_agg_mode: str,
    value_coef: float,
) -> Tensor:
    """The micro-batch's share of its mini-batch's loss, so that the summed gradients are the mini-batch's.

    L = w · L_actor + value_coef · s · L_critic, with w = ``micro_batch_weight`` over ``loss_mask`` in
    ``loss_agg_mode`` and s the micro-batch's share of the mini-batch's policy tokens (token-mean).
    """
    weight = micro_batch_weight(micro.loss_mask, mini.loss_mask, loss_agg_mode)
    loss = actor_loss * weight.to(actor_loss.dtype)
    if critic_loss is not None:
        share = micro_batch_weight(micro.policy_mask, mini.policy_mask, "token-mean")
        loss = loss + value_coef * critic_loss * share.to(critic_loss.dtype)
    return loss


def in_sample_order(parts: list[tuple[Tensor, Tensor]], device: torch.device) -> Tensor:
    """(B, R) the rows of each (sample indices, (b, R) rows) part put back at their samples' places."""
    order = torch.cat([samples for samples, _ in parts])
    return torch.cat([rows for _, rows in parts])[torch.argsort(order).to(device)]
