"""Numerical guard: skip an optimizer step whose loss or gradient is NaN/Inf, and stop after too many."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor

from lit_offpolicy.core.checks import check_range
from lit_offpolicy.core.experience import Experience

log = logging.getLogger(__name__)


class NonFiniteGuard:
    """Decides, before each optimizer step, whether its loss and gradients are all finite.

    A non-finite step is skipped by the caller (gradients zeroed, no optimizer or scheduler step)
    and logged here with the statistics of its mini-batch; after ``max_in_a_row`` consecutive
    non-finite steps the run stops with a ``RuntimeError``. A finite step resets the count.

    Args:
        max_in_a_row: consecutive non-finite optimizer steps that stop the run (≥ 1).
    """

    def __init__(self, max_in_a_row: int) -> None:
        self.max_in_a_row = check_range("max_consecutive_nonfinite", max_in_a_row, low=1)
        self.in_a_row = 0
        self.total_skipped = 0

    def is_finite(
        self,
        loss: Tensor,
        parameters: Iterable[torch.nn.Parameter],
        batch: Experience,
        reduce: Callable[[bool], bool] = bool,
    ) -> bool:
        """True when ``loss`` and every gradient are finite; otherwise log, count, and maybe raise.

        ``reduce`` combines the verdict over processes (``strategy.reduce_boolean_decision``), so
        every rank skips the same steps even when gradients are sharded.
        """
        # sharded (FSDP2 DTensor) gradients are checked shard by shard: ``reduce`` combines the ranks
        grads = [_local(p.grad) for p in parameters if p.grad is not None]
        checks = [torch.isfinite(loss).all(), *(all_finite(g) for g in grads)]
        finite = reduce(bool(torch.stack([c.to(checks[0].device) for c in checks]).all()))
        if finite:
            self.in_a_row = 0
            return True
        self.in_a_row += 1
        self.total_skipped += 1
        stats = batch_statistics(batch)
        stats["loss"] = float(loss)
        stats["nonfinite_grads"] = sum(int(not all_finite(g)) for g in grads)
        summary = ", ".join(f"{name}={value:.4g}" for name, value in stats.items())
        log.warning(
            f"skipped an optimizer step with a non-finite loss or gradient "
            f"({self.in_a_row} in a row, {self.total_skipped} in all); batch: {summary}"
        )
        if self.in_a_row >= self.max_in_a_row:
            raise RuntimeError(
                f"{self.in_a_row} optimizer steps in a row had a non-finite loss or gradient "
                f"(max_consecutive_nonfinite={self.max_in_a_row}); last batch: {summary}. "
                "Lower lr, set max_grad_norm, or check the rewards and the rollout log-probs."
            )
        return False

    def state_dict(self) -> dict[str, int]:
        return {"in_a_row": self.in_a_row, "total_skipped": self.total_skipped}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.in_a_row = state["in_a_row"]
        self.total_skipped = state["total_skipped"]


def all_finite(tensor: Tensor) -> Tensor:
    """True (a 0-dim bool tensor) when no element is NaN or ±Inf: its minimum and maximum are finite
    (both propagate NaN). Unlike ``torch.isfinite(tensor).all()``, which builds the absolute values
    and two masks (≈ 1.75× a float32 tensor; 514 MiB for a 151,936 × 512 LM head's gradient), it
    allocates nothing of the tensor's size, and it is faster."""
    if tensor.numel() == 0:
        return torch.ones((), dtype=torch.bool, device=tensor.device)
    return torch.isfinite(torch.stack(torch.aminmax(tensor))).all()


def _local(tensor: Tensor) -> Tensor:
    """This rank's shard of a ``DTensor``; any other tensor as it is."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def batch_statistics(exp: Experience) -> dict[str, float]:
    """What explains a NaN: reward range, |advantage| max, log-prob ranges over valid tokens, IS max.

    Ranges are over the finite values; ``*_nonfinite`` counts the NaN/Inf entries next to them.
    """
    mask = exp.policy_mask.bool()
    stats = _range("reward", exp.scores)
    if exp.advantages is not None:
        stats.update(_range("advantage_abs", exp.advantages[mask].abs(), low=False))
    for name in ("rollout_log_probs", "old_log_probs", "ref_log_probs"):
        tensor = getattr(exp, name)
        if tensor is not None:
            stats.update(_range(name, tensor[mask]))
    if exp.is_weights is not None:
        stats.update(_range("is_weight", exp.is_weights[mask], low=False))
    return stats


def _range(name: str, values: Tensor, low: bool = True) -> dict[str, float]:
    values = values.detach().float().flatten()
    finite = values[torch.isfinite(values)]
    stats = {f"{name}_nonfinite": float((~torch.isfinite(values)).sum())}
    if finite.numel():
        if low:
            stats[f"{name}_min"] = finite.min().item()
            stats[f"{name}_mean"] = finite.mean().item()
        stats[f"{name}_max"] = finite.max().item()
    return stats
