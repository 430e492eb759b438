"""The models of a training step's teacher-forced passes, and how those passes run."""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from lit_offpolicy.training.sequence_parallel import SequenceGroup


@dataclass(frozen=True)
class Passes:
    """Actor, critic and reference of one step, and the options of their forward passes."""

    actor: nn.Module
    """π_θ (a peft model with LoRA)."""
    critic: nn.Module | None
    """The value model; None without a critic."""
    reference: nn.Module | None
    """π_ref as a model of its own; None where there is none, or where it is the actor unadapted."""
    reference_is_base: bool
    """π_ref is the actor with its LoRA adapters disabled (peft's ``disable_adapter``: the base model's
    forward, on the same weights), so no second copy of the base weights is held."""
    chunk_size: int | None
    """Response tokens per LM-head chunk (``logprob_chunk_size``); None: the whole (b, R, V) logits."""
    padding_free: bool
    """Each micro-batch's samples packed into one row without padding (``training.packing``)."""
    teacher: nn.Module | None = None
    """On-policy distillation's frozen teacher (``DistillOptions``); None without one."""
    actor_version: int = 0
    """The weight version of ``actor`` (``OffPolicyModule.policy_version``): a response token sampled
    by an older version is stale (``training.behaviour``)."""
    sequence: SequenceGroup | None = None
    """The ranks each packed row is split across (``training.sequence_parallel``); None: this rank alone."""
    shared_prefix: bool = False
    """Each prompt once for the samples of a micro-batch sharing it, in each model that runs it
    (``training.shared_prefix``)."""
