"""Padding-free batches: a micro-batch's samples packed end to end in one row, and back.

Sample i's real tokens (its prompt without the left padding, then its response without the right
padding: L_i tokens) follow sample i − 1's in one row of N = Σ_i L_i tokens, with ``position_ids``
0 … L_i − 1 restarting at each sample. Each sample attends within itself only: "sdpa" models run one
causal attention call per sample (``lit_offpolicy.training.packed_attention``); others, called with these
positions and no attention mask, read the boundaries off the restarts (a position that is not the
previous one + 1): a block-diagonal causal mask for "eager", the variable-length kernel for
"flash_attention_2". Response token j of sample i, at packed index q, is predicted by the hidden state
at q − 1 (teacher forcing), as in the padded layout.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

from torch import Tensor, nn

from lit_offpolicy.core.experience import Experience
from lit_offpolicy.training.packed_attention import attention_within_samples, shared_row_index


@dataclass(frozen=True)
class PackedBatch:
    """One micro-batch without padding: the model's inputs and where its response tokens go."""

    input_ids: Tensor
    """(1, N) the samples' real tokens, end to end."""
    position_ids: Tensor
    """(1, N) each token's position in its own sample."""
    predicting: Tensor
    """(T,) the packed indices whose hidden states predict the T = Σ_i R_i response tokens."""
    targets: Tensor
    """(1, T) the response tokens, in the same order."""
    rows: Tensor
    """(T,) each response token's sample."""
    columns: Tensor
    """(T,) each response token's index in its (right-padded) response."""
    shape: tuple[int, int]
    """(B, R): the padded responses' shape."""
    lengths: tuple[int, ...]
    """Each sample's L_i, in row order (``training.packed_attention`` splits the row by them); in a
    shared-prefix row, each prompt's length, then its responses' (``training.shared_prefix``)."""
    fan_out: tuple[int, ...] | None = None
    """A shared-prefix row: the responses after each prompt; None: a row of whole samples."""

    def attention(self, model: nn.Module) -> contextlib.AbstractContextManager:
        """Inside: ``model`` attends within each sample of the row (``training.packed_attention``)."""
        if self.fan_out is None:
            return attention_within_samples(model, self.lengths)
        shared = shared_row_index(self.lengths, self.fan_out, self.input_ids.device)
        return attention_within_samples(model, self.lengths, shared=shared)

    def unpack(self, packed: Tensor) -> Tensor:
        """(1, T, ...) per response token -> (B, R, ...), 0 at padding; differentiable."""
        padded = packed.new_zeros((*self.shape, *packed.shape[2:]))
        return padded.index_put((self.rows, self.columns), packed[0])


def pack(exp: Experience) -> PackedBatch:
    """The padding-free layout of ``exp`` (every sample needs at least one prompt token)."""
    prompt_width = exp.prompt_ids.shape[1]
    mask = exp.attention_mask.bool()
    if not exp.prompt_mask.bool().any(dim=1).all():
        raise ValueError("padding_free=True needs at least one prompt token per sample; got an empty prompt")
    packed_index = mask.flatten().long().cumsum(0).reshape(mask.shape) - 1
    response_mask = exp.response_mask.bool()
    rows, columns = response_mask.nonzero(as_tuple=True)
    positions = (mask.long().cumsum(dim=1) - 1)[mask]
    return PackedBatch(
        input_ids=exp.input_ids[mask].unsqueeze(0),
        position_ids=positions.unsqueeze(0),
        predicting=packed_index[:, prompt_width:][response_mask] - 1,
        targets=exp.response_ids[response_mask].unsqueeze(0),
        rows=rows,
        columns=columns,
        shape=tuple(exp.response_ids.shape),
        lengths=tuple(sample_lengths(exp).tolist()),
    )


def sample_lengths(exp: Experience) -> Tensor:
    """(B,) each sample's real tokens, prompt + response: its length in the packed row."""
    return exp.prompt_mask.sum(dim=1) + exp.response_mask.sum(dim=1)
