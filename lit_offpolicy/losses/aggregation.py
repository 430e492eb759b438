"""Reduce a per-token loss matrix to a scalar: the four loss aggregation modes of verl and ROLL."""

from __future__ import annotations

import torch
from torch import Tensor

from lit_offpolicy.core.checks import check_choice
from lit_offpolicy.core.masked import masked_count, masked_mean, masked_sum

LOSS_AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")


def aggregate(loss_mat: Tensor, mask: Tensor, loss_agg_mode: str = "token-mean") -> Tensor:
    """Aggregate ``loss_mat`` (batch, T) over the valid tokens of ``mask``.

    With L_it the loss of token t of sequence i, |o_i| its valid length, S the sequences that have
    at least one valid token (fully masked rows are not counted) and T the mask's length:

    - ``token-mean``:              Σ_i Σ_t L_it / Σ_i |o_i|                      (DAPO; verl's default)
    - ``seq-mean-token-sum``:      (1/|S|) Σ_{i∈S} Σ_t L_it                      (ROLL's default)
    - ``seq-mean-token-mean``:     (1/|S|) Σ_{i∈S} (1/|o_i|) Σ_t L_it            (GRPO paper)
    - ``seq-mean-token-sum-norm``: Σ_i Σ_t L_it / T                              (Dr. GRPO; as verl and
      ROLL compute it: the divisor is the mask's length, a constant when T is fixed)

    An empty batch (no valid token) gives 0, never NaN.
    """
    check_choice("loss_agg_mode", loss_agg_mode, LOSS_AGG_MODES)
    if loss_agg_mode == "token-mean":
        return masked_mean(loss_mat, mask)
    seq_sums = masked_sum(loss_mat, mask, dim=-1)
    if loss_agg_mode == "seq-mean-token-sum-norm":
        return seq_sums.sum() / max(mask.shape[-1], 1)
    lengths = masked_count(mask, dim=-1).to(loss_mat.dtype)
    num_sequences = (lengths > 0).sum().clamp(min=1)
    if loss_agg_mode == "seq-mean-token-sum":
        return seq_sums.sum() / num_sequences
    return (seq_sums / lengths.clamp(min=1)).sum() / num_sequences


def micro_batch_weight(micro_mask: Tensor, mini_mask: Tensor, loss_agg_mode: str) -> Tensor:
    """w such that Σ_micro w·aggregate(micro) = aggregate(mini): exact gradient accumulation.

    token-mean weighs a micro-batch by its share of the mini-batch's valid tokens, the seq-mean
    modes by its share of non-empty sequences; seq-mean-token-sum-norm is a plain sum (w = 1).
    A 0-dim float64 tensor on the masks' device (0 for an empty mini-batch): no host sync; cast it to
    the loss's dtype before multiplying, as a Python float would be.
    """
    check_choice("loss_agg_mode", loss_agg_mode, LOSS_AGG_MODES)
    if loss_agg_mode == "seq-mean-token-sum-norm":
        return torch.ones((), dtype=torch.float64, device=micro_mask.device)
    if loss_agg_mode == "token-mean":
        part, whole = masked_count(micro_mask), masked_count(mini_mask)
    else:
        part = (masked_count(micro_mask, dim=-1) > 0).sum()
        whole = (masked_count(mini_mask, dim=-1) > 0).sum()
    return part.to(torch.float64) / whole.clamp(min=1).to(torch.float64)
