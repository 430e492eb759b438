"""The step's no-grad passes: π_old (where it is recomputed), the reference's log-probs, the values."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from lit_offpolicy.core.experience import Experience
from lit_offpolicy.core.records import OldLogProbs
from lit_offpolicy.correction import RolloutCorrection
from lit_offpolicy.training.forward import critic_values, frozen_log_probs
from lit_offpolicy.training.options import KLOptions, UpdateOptions
from lit_offpolicy.training.passes import Passes
from lit_offpolicy.training.shared_prefix import shared_prompts


def old_log_probs_sources(
    batch_size: int,
    correction: RolloutCorrection,
    update: UpdateOptions,
    kl: KLOptions,
    old_before_update: bool = False,
) -> tuple[OldLogProbs, ...]:
    """The sources of π_old valid for this configuration and batch, the one needing no update first.

    Bypass mode (``RolloutCorrection.bypass_mode``) takes π_rollout. Otherwise, with one optimizer
    step per RL step (one epoch, one mini-batch) every micro-batch's forward runs on the weights π_old
    is defined by, so π_old = π_θ.detach() of the update's forward exactly (as TRL) and the no-grad
    pass can be skipped (``OldLogProbs.UPDATE``). That holds only while π_old is not needed before the
    update: not for a reward KL penalty, not for on-policy distillation's advantage
    (``old_before_update``), and not for a rollout correction that reaches the loss
    (``RolloutCorrection.changes_the_loss``). Everything else recomputes π_old before the update.
    """
    if not correction.requires_old_log_probs:
        return (OldLogProbs.ROLLOUT,)
    one_step = update.ppo_epochs == 1 and (update.mini_batch_size or batch_size) >= batch_size
    if one_step and not kl.use_in_reward and not correction.changes_the_loss and not old_before_update:
        return (OldLogProbs.RECOMPUTE, OldLogProbs.UPDATE)
    return (OldLogProbs.RECOMPUTE,)


def checked_source(
    source: OldLogProbs | None,
    batch_size: int,
    correction: RolloutCorrection,
    update: UpdateOptions,
    kl: KLOptions,
    old_before_update: bool = False,
) -> OldLogProbs:
    """``source`` if ``old_log_probs_sources`` allows it (else an error); None: the first source allowed."""
    allowed = old_log_probs_sources(batch_size, correction, update, kl, old_before_update)
    source = allowed[0] if source is None else source
    if source not in allowed:
        names = ", ".join(repr(s.value) for s in allowed)
        raise ValueError(
            f"old_log_probs={source.value!r} is not supported here (bypass mode takes π_rollout; the "
            "update's forward needs one optimizer step per RL step, no reward KL penalty and no "
            f"loss-changing rollout correction); allowed values: {names}"
        )
    return source


@dataclass(frozen=True)
class FrozenPasses:
    """The no-grad passes over an Experience of B samples with R response tokens."""

    old_log_probs: Tensor | None
    """(B, R) log π_old of each response token: π_rollout itself (``OldLogProbs.ROLLOUT``), a no-grad
    pass of the actor (``RECOMPUTE``), or None (``UPDATE``: the update's forward fills it)."""
    ref_log_probs: Tensor | None
    """(B, R) log π_ref; without a reference, what the experience already held (None from a rollout)."""
    values: Tensor | None
    """(B, R) the critic's V of the state before each response token; without a critic, what the
    experience already held (None from a rollout)."""
    teacher_log_probs: Tensor | None = None
    """(B, R) log π_teacher of each response token (on-policy distillation); None without a teacher."""
    forwards: tuple[nn.Module, ...] = ()
    """The models whose forward ran, once each (their FLOPs: ``core.flops``)."""
    shared_prompts: list[int] | None = None
    """The prompts the actor's shared-prefix rows computed once for several samples: P once per sample
    beyond the first (``shared_prefix.shared_prompts``; ``core.flops`` leaves them out); None: off."""


@torch.no_grad()
def frozen_passes(
    exp: Experience, source: OldLogProbs, micro_batches: list[Tensor], passes: Passes
) -> FrozenPasses:
    """π_old, π_ref, V and π_teacher of ``exp`` in this order, one forward per micro-batch (groups of
    sample indices, the LM head in the reference's chunks), each result back in ``exp``'s sample order."""
    temperature = exp.temperature
    options = (passes.chunk_size, passes.padding_free, passes.sequence, passes.shared_prefix)
    forwards: list[nn.Module] = []
    if source is OldLogProbs.ROLLOUT:
        old = exp.rollout_log_probs  # bypass mode: π_old := π_rollout
    elif source is OldLogProbs.UPDATE:
        old = None  # the update's forward fills it
    else:
        old = frozen_log_probs(passes.actor, exp, temperature, micro_batches, *options)
        forwards.append(passes.actor)
    ref = exp.ref_log_probs
    if passes.reference is not None:
        ref = frozen_log_probs(passes.reference, exp, temperature, micro_batches, *options)
        forwards.append(passes.reference)
    elif passes.reference_is_base:
        with passes.actor.disable_adapter():  # peft: the base model's forward, the same weights
            ref = frozen_log_probs(passes.actor, exp, temperature, micro_batches, *options)
        forwards.append(passes.actor)
    values = exp.values
    if passes.critic is not None:
        order = torch.argsort(torch.cat(micro_batches)).to(exp.response_ids.device)
        rows = [exp.select(group.to(order.device)) for group in micro_batches]
        parts = [critic_values(passes.critic, row, *options[1:]) for row in rows]
        values = torch.cat(parts)[order]
        forwards.append(passes.critic)
    teacher = None
    if passes.teacher is not None:
        teacher = frozen_log_probs(passes.teacher, exp, temperature, micro_batches, *options)
        forwards.append(passes.teacher)
    return FrozenPasses(
        old_log_probs=old,
        ref_log_probs=ref,
        values=values,
        teacher_log_probs=teacher,
        forwards=tuple(forwards),
        shared_prompts=shared_prompts(passes.actor, exp, micro_batches) if passes.shared_prefix else None,
    )
