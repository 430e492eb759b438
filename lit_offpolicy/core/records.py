"""Typed records that pass between the rollout callbacks and the module, and what a callback may read.

- ``RolloutResult``: one generated batch (experience, its ``rollout/*`` and ``reward/*`` metrics, a
  few sample texts).
- ``OldLogProbs``: where a step's π_old comes from, decided once per step.
- ``StepRecord``: the module's last finished step, for callbacks that look at it afterwards.
- ``RolloutHost``: the module's side of the contract (``OffPolicyModule`` implements it).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import torch

from lit_offpolicy.core.experience import Experience

if TYPE_CHECKING:
    import lightning as L


@dataclass(frozen=True)
class RolloutResult:
    """One batch of rollouts: the experience to train on, its metrics and a few readable samples."""

    experience: Experience
    """The B samples to train on (after any group filtering)."""
    metrics: dict[str, float]
    """``rollout/*``, ``reward/*``, ``timing/*`` (and ``env/*``) by name, over every sample generated."""
    texts: list[str]
    """A few samples as readable text (prompt → response, answer, score), one per prompt."""


class OldLogProbs(StrEnum):
    """The source of π_old for one step (logged as ``actor/old_log_probs_source``, the value's index).

    - ``ROLLOUT``: π_rollout as the engine reported it (bypass mode; no pass at all);
    - ``RECOMPUTE``: a no-grad pass of the actor before the update (the decoupled, standard mode);
    - ``UPDATE``: read off the update's own forward, π_θ.detach() before its only optimizer step.
    """

    ROLLOUT = "rollout"
    RECOMPUTE = "recompute"
    UPDATE = "update"

    @property
    def code(self) -> float:
        return float(list(OldLogProbs).index(self))


@dataclass(frozen=True)
class StepRecord:
    """The last finished training step, for callbacks that read it afterwards."""

    experience: Experience
    """The step's samples as prepare and update left them (π_old, advantages, loss mask, IS weights)."""
    version_before: int
    """The policy version the step started from."""
    version_after: int
    """The policy version after its update."""
    old_log_probs: OldLogProbs
    """Where the step's π_old came from."""


@runtime_checkable
class RolloutHost(Protocol):
    """What the rollout callbacks read of the LightningModule they serve (``OffPolicyModule`` is one)."""

    tokenizer: Any
    """The actor's tokenizer (a transformers tokenizer)."""
    actor: torch.nn.Module
    """The policy being trained."""
    policy_version: int
    """RL steps done: the version of the actor's weights."""
    model_path: str
    """The directory the actor was loaded from (engines load it too)."""
    model_dtype: str
    """The actor's parameter dtype by name ("float32", "bfloat16")."""
    last_step: StepRecord | None
    """The last finished step; None before the first."""

    @property
    def device(self) -> torch.device: ...

    @property
    def trainer(self) -> L.Trainer: ...

    def log(self, name: str, value: float, **kwargs: Any) -> None:
        """LightningModule.log, for the callbacks' own metrics."""

    def log_dict(self, metrics: dict[str, float], **kwargs: Any) -> None:
        """LightningModule.log_dict."""
