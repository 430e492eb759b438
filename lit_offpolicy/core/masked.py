"""Masked reductions over (batch, response_length) tensors.

A mask is 1 (or True) on valid response tokens and 0 on padding. Padding may hold any value,
NaN included: every function here selects with ``torch.where`` so that padding never leaks into
a result or a gradient.
"""

from __future__ import annotations

import torch
from torch import Tensor


def as_float_mask(mask: Tensor, like: Tensor) -> Tensor:
    """The mask as 0/1 values in ``like``'s dtype and device."""
    return mask.to(device=like.device, dtype=like.dtype)


def zero_padding(values: Tensor, mask: Tensor) -> Tensor:
    """``values`` with every padded position set to 0 (NaN/Inf in padding included)."""
    return torch.where(mask.bool(), values, torch.zeros_like(values))


def masked_sum(values: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Σ values over valid positions (all of them, or along ``dim``)."""
    values = zero_padding(values, mask)
    return values.sum() if dim is None else values.sum(dim=dim)


def masked_count(mask: Tensor, dim: int | None = None) -> Tensor:
    """Number of valid positions (all, or along ``dim``), as a float tensor."""
    count = mask.bool().float()
    return count.sum() if dim is None else count.sum(dim=dim)


def masked_mean(values: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Σ values / number of valid positions; 0 where there is no valid position."""
    count = masked_count(mask, dim).to(values.dtype)
    return masked_sum(values, mask, dim) / count.clamp(min=1)


def masked_var(values: Tensor, mask: Tensor, unbiased: bool = True) -> Tensor:
    """Variance over all valid positions; Bessel-corrected when ``unbiased`` (needs ≥ 2 of them)."""
    mean = masked_mean(values, mask)
    squared = masked_mean((values - mean) ** 2, mask)
    if not unbiased:
        return squared
    count = masked_count(mask).to(values.dtype)
    return squared * count / (count - 1).clamp(min=1)


def masked_whiten(values: Tensor, mask: Tensor, shift_mean: bool = True, eps: float = 1e-8) -> Tensor:
    """(values − mean) / sqrt(var + eps) over valid positions; padding stays 0.

    With ``shift_mean=False`` the mean is added back (scale only), as in TRL/verl's whiten.
    Fewer than two valid positions leave the values centred but unscaled (var is taken as 1).
    """
    mean = masked_mean(values, mask)
    count = masked_count(mask)
    var = masked_var(values, mask) if count >= 2 else torch.ones((), dtype=values.dtype)
    whitened = (values - mean) * torch.rsqrt(var + eps)
    if not shift_mean:
        whitened = whitened + mean
    return zero_padding(whitened, mask)


def compaction_order(mask: Tensor) -> Tensor:
    """Per row, the permutation that moves the valid positions of ``mask`` to the front, in order
    (a stable sort): ``values.gather(-1, order)`` is right-padded, ``expand_compacted`` undoes it."""
    return torch.sort((~mask.bool()).to(torch.uint8), dim=-1, stable=True).indices


def expand_compacted(compacted: Tensor, order: Tensor) -> Tensor:
    """The inverse of ``gather(-1, order)``: every value back at the position it came from."""
    return torch.empty_like(compacted).scatter_(-1, order, compacted)
