"""The fields of an Experience that the RL step fills, and the one function that writes them."""

from __future__ import annotations

from torch import Tensor

from lit_offpolicy.core.experience import Experience

FILLED = ("old_log_probs", "ref_log_probs", "values", "advantages", "returns", "loss_mask", "is_weights")
"""What the step adds to the rollout's Experience, each (B, R) or None: π_old, π_ref and V (the frozen
passes), the advantages and returns (shaping), the loss mask and IS weights (rollout correction)."""


def fill(exp: Experience, **fields: Tensor | None) -> None:
    """Write ``fields`` into ``exp`` in place: every write of a ``FILLED`` field goes through here.

    ``prepare`` writes all of them at once at its end; with π_old read off the update's forward
    (``OldLogProbs.UPDATE``) the update writes π_old, the loss mask and the IS weights after it.
    """
    unknown = sorted(set(fields) - set(FILLED))
    if unknown:
        raise ValueError(f"fill: {unknown} are not fields the step fills; allowed values: {list(FILLED)}")
    for name, value in fields.items():
        setattr(exp, name, value)
