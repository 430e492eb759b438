"""A packed row split across a sequence group, and attention over it: Ulysses' exchanges (Jacobs et al.
2023, arXiv:2309.14509).

``shard`` pads a micro-batch's packed row (``training.packing``) of n tokens to N·c tokens (the padding
is one more sample, attending to itself only); rank r of the group (``training.sequence_parallel``) runs
the model on tokens [r·c, (r + 1)·c), with their own positions. Everything but attention acts on each
token alone: embeddings, norms, MLPs, rotary embeddings (from the positions), the LM head. Attention
exchanges, by one all-to-all each, its (1, H, c, D) queries, keys and values for (1, H/N, N·c, D): the
whole row, for H/N of the heads; runs per-sample attention over the whole row
(``training.packed_attention``); and exchanges the (1, N·c, H/N, D) output back to (1, c, H, D). The
gradient of an exchange is the same exchange of the output's gradient. With fewer key/value heads than
ranks, each key/value head goes to the N / H_kv ranks whose query heads read it.

Each rank takes log-probs, entropy and values at the positions of its own tokens that predict a
response token; ``SequenceShard.unpack`` gathers them over the group into the (B, R) layout. Every
rank of the group then computes the same loss from the same values, so the gather's backward keeps
the rank's own slice of the gradient, and the parameters' gradients, summed over the group, are the
one-rank gradients (data parallelism averages over all ranks: the module scales the loss by N).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor, nn
from transformers import AttentionInterface

from lit_offpolicy.core.row_attention import row_attention
from lit_offpolicy.training.packed_attention import attention_within_samples, per_sample_sdpa
from lit_offpolicy.training.packing import PackedBatch
from lit_offpolicy.training.sequence_parallel import SequenceGroup

ULYSSES = "lit_offpolicy_ulysses"


@dataclass(frozen=True)
class SequenceShard:
    """This rank's tokens of a packed row: the model's inputs, as ``PackedBatch`` has them for a row."""

    full: PackedBatch
    """The whole row."""
    sequence: SequenceGroup
    input_ids: Tensor
    """(1, c) tokens [r·c, (r + 1)·c) of the row padded to N·c."""
    position_ids: Tensor
    """(1, c) their positions in their samples."""
    predicting: Tensor
    """(t_r,) the positions among them that predict a response token (indices into the c tokens)."""
    targets: Tensor
    """(1, t_r) those response tokens: ``full.targets[:, start : start + t_r]``."""
    counts: tuple[int, ...]
    """t_r of each rank of the group."""
    lengths: tuple[int, ...]
    """The samples' lengths over the whole padded row (the padding last, when there is some)."""

    @contextlib.contextmanager
    def attention(self, model: nn.Module) -> Iterator[None]:
        """Inside: ``model``'s attention runs Ulysses over the group, per sample over the whole row."""
        with attention_within_samples(model, self.lengths, ULYSSES, self.sequence) as switched:
            if not switched:
                raise ValueError(
                    f"update.sequence_parallel={self.sequence.size} attends over whole samples, and a sample "
                    f"of {max(self.full.lengths)} tokens is longer than the model's sliding window; allowed "
                    "values: update.sequence_parallel=1 for this model, or shorter samples"
                )
            yield

    def unpack(self, local: Tensor) -> Tensor:
        """(1, t_r, ...) of this rank -> (B, R, ...) of the whole row, the same on every rank of the group."""
        return self.full.unpack(_GatherTokens.apply(local, self.counts, self.sequence))


def shard(packed: PackedBatch, sequence: SequenceGroup) -> SequenceShard:
    """This rank's share of ``packed``: its tokens, and the response tokens its positions predict."""
    total, size = packed.input_ids.shape[1], sequence.size
    width = -(-total // size)
    padding = width * size - total
    input_ids = torch.nn.functional.pad(packed.input_ids, (0, padding))
    padded_positions = torch.arange(padding, device=packed.position_ids.device).unsqueeze(0)
    positions = torch.cat([packed.position_ids, padded_positions], dim=1)
    bounds = torch.arange(size + 1, device=packed.predicting.device) * width
    cuts = torch.searchsorted(packed.predicting, bounds).tolist()  # predicting is increasing
    counts = tuple(b - a for a, b in zip(cuts[:-1], cuts[1:], strict=True))
    start, end = cuts[sequence.rank], cuts[sequence.rank + 1]
    mine = slice(sequence.rank * width, (sequence.rank + 1) * width)
    return SequenceShard(
        full=packed,
        sequence=sequence,
        input_ids=input_ids[:, mine],
        position_ids=positions[:, mine],
        predicting=packed.predicting[start:end] - sequence.rank * width,
        targets=packed.targets[:, start:end],
        counts=counts,
        lengths=packed.lengths + ((padding,) if padding else ()),
    )


def _exchange(tensor: Tensor, group: dist.ProcessGroup) -> Tensor:
    """Block j of ``tensor``'s first dimension to rank j; block i of the result from rank i (autograd)."""
    return _Exchange.apply(tensor, group)


class _Exchange(torch.autograd.Function):
    """An all-to-all of equal blocks; its gradient is the same exchange of the output's gradient."""

    @staticmethod
    def forward(ctx, tensor: Tensor, group: dist.ProcessGroup) -> Tensor:
        ctx.group = group
        return _all_to_all(tensor, group)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return _all_to_all(grad, ctx.group), None


def _all_to_all(tensor: Tensor, group: dist.ProcessGroup) -> Tensor:
    tensor = tensor.contiguous()  # the collective reads and writes both as contiguous memory
    received = torch.empty_like(tensor, memory_format=torch.contiguous_format)
    dist.all_to_all_single(received, tensor, group=group)
    return received


def _heads_to_sequence(states: Tensor, sequence: SequenceGroup) -> Tensor:
    """(1, H, c, D), this rank's tokens, all heads -> (1, H/N, N·c, D), all tokens, this rank's heads."""
    size, (_, heads, width, dim) = sequence.size, states.shape
    if heads < size:  # fewer key/value heads than ranks: each goes to the ranks of its query heads
        states, heads = states.repeat_interleave(size // heads, dim=1), size
    blocks = states.reshape(size, heads // size, width, dim)  # block j: the heads rank j attends with
    received = _exchange(blocks, sequence.group)  # block i: rank i's tokens
    return received.transpose(0, 1).reshape(1, heads // size, size * width, dim)


def _sequence_to_heads(output: Tensor, sequence: SequenceGroup) -> Tensor:
    """(1, N·c, H/N, D), all tokens, this rank's heads -> (1, c, H, D), this rank's tokens, all heads."""
    size, (_, total, heads, dim) = sequence.size, output.shape
    blocks = output.reshape(size, total // size, heads, dim)  # block j: rank j's tokens
    received = _exchange(blocks, sequence.group)  # block i: the heads rank i attended with
    return received.transpose(0, 1).reshape(1, total // size, size * heads, dim)


@torch.compiler.disable
def ulysses_attention(
    module: nn.Module, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None, **kwargs
) -> tuple[Tensor, None]:
    """transformers' attention-function contract on this rank's tokens: (1, H, c, D) queries, (1, H_kv, c, D)
    keys and values -> (1, c, H, D), attending per sample over the group's whole row."""
    row = row_attention()
    if row is None or not isinstance(row.group, SequenceGroup):
        raise RuntimeError(f"{ULYSSES} attention runs only inside SequenceShard.attention()")
    sequence = row.group
    query, key, value = (_heads_to_sequence(t, sequence) for t in (query, key, value))
    output, _ = per_sample_sdpa(module, query, key, value, None, **kwargs)
    return _sequence_to_heads(output, sequence), None


AttentionInterface.register(ULYSSES, ulysses_attention)


class _GatherTokens(torch.autograd.Function):
    """(1, t_r, ...) on each rank -> (1, Σ t_r, ...) in rank order; backward: this rank's slice only."""

    @staticmethod
    def forward(ctx, local: Tensor, counts: tuple[int, ...], sequence: SequenceGroup) -> Tensor:
        widest = max(counts)
        padded = local.new_zeros((1, widest, *local.shape[2:]))
        padded[:, : local.shape[1]] = local
        parts = [torch.empty_like(padded) for _ in counts]
        dist.all_gather(parts, padded.contiguous(), group=sequence.group)
        ctx.start, ctx.count = sum(counts[: sequence.rank]), counts[sequence.rank]
        return torch.cat([part[:, :n] for part, n in zip(parts, counts, strict=True)], dim=1)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return grad[:, ctx.start : ctx.start + ctx.count], None, None
