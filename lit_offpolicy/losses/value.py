"""The critic's loss: squared error to the returns, optionally clipped around the old values (PPO)."""

from __future__ import annotations

import torch
from torch import Tensor

from lit_offpolicy.core.checks import check_range
from lit_offpolicy.core.masked import zero_padding
from lit_offpolicy.losses.aggregation import aggregate
from lit_offpolicy.losses.base import masked_fraction


def value_loss(
    values: Tensor,
    old_values: Tensor,
    returns: Tensor,
    response_mask: Tensor,
    value_clip: float | None = None,
    loss_agg_mode: str = "token-mean",
) -> tuple[Tensor, dict[str, Tensor]]:
    """L_V = ½·agg(max((V − R)², (V_clip − R)²)), V_clip = V_old + clip(V − V_old, −c, c).

    Without ``value_clip`` it is ½·agg((V − R)²). As verl's ``compute_value_loss`` and the PPO
    paper's value clipping. Returns the loss and ``vf_clipfrac`` (valid tokens where the clipped
    term is the larger).
    """
    mask = response_mask.bool()
    values = zero_padding(values, mask)
    returns = zero_padding(returns.detach().to(values.dtype), mask)
    squared_error = (values - returns) ** 2
    clipfrac = torch.zeros((), dtype=values.dtype)
    if value_clip is not None:
        check_range("value_clip", value_clip, low=0.0, low_inclusive=False)
        old_values = zero_padding(old_values.detach().to(values.dtype), mask)
        clipped = old_values + (values - old_values).clamp(-value_clip, value_clip)
        clipped_error = (clipped - returns) ** 2
        clipfrac = masked_fraction(clipped_error > squared_error, mask)
        squared_error = torch.maximum(squared_error, clipped_error)
    loss = 0.5 * aggregate(squared_error, mask, loss_agg_mode)
    return loss, {"vf_loss": loss.detach(), "vf_clipfrac": clipfrac}
