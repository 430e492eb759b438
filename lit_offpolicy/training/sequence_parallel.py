"""Sequence parallelism, Ulysses style (Jacobs et al. 2023, arXiv:2309.14509): one packed row across N ranks.

A micro-batch's packed row (``training.packing``) of n tokens is padded to N·c tokens (the padding is
one more sample, attending to itself only) and rank r of a sequence group of N ranks runs the model on
tokens [r·c, (r + 1)·c), with their own positions. Everything but attention acts on each token alone:
embeddings, norms, MLPs, rotary embeddings (from the positions), the LM head. Attention exchanges, by
one all-to-all each, its (1, H, c, D) queries, keys and values for (1, H/N, N·c, D): the whole row, for
H/N of the heads; runs per-sample attention over the whole row (``training.packed_attention``); and
exchanges the (1, N·c, H/N, D) output back to (1, c, H, D). The gradient of an exchange is the same
exchange of the output's gradient. With fewer key/value heads than ranks, each
key/value head goes to the N / H_kv ranks whose query heads read it.

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
from lightning.pytorch.strategies import DeepSpeedStrategy, Strategy
from lightning.pytorch.utilities import rank_zero_info
from torch import Tensor, nn
from transformers import AttentionInterface

from lit_offpolicy.core.experience import Experience
from lit_offpolicy.core.memory import MMAP_THRESHOLD_BYTES, map_large_blocks
from lit_offpolicy.core.row_attention import row_attention
from lit_offpolicy.training.packed_attention import (
    PER_SAMPLE_MODEL_TYPES,
    attention_within_samples,
    per_sample_sdpa,
)
from lit_offpolicy.training.packing import PackedBatch

ULYSSES = "lit_offpolicy_ulysses"


@dataclass(frozen=True)
class SequenceGroup:
    """This rank's sequence group (N ranks sharing each packed row) and data group (the ranks at the same
    place in the other sequence groups: one replica each)."""

    group: dist.ProcessGroup
    size: int
    rank: int
    data_group: dist.ProcessGroup


def sequence_groups(size: int) -> SequenceGroup | None:
    """Consecutive ranks in groups of ``size`` (ranks 0 … N − 1, N … 2N − 1, ...); None for 1. A collective:
    every rank calls it (``check`` first: ``size`` divides the world size)."""
    if size == 1:
        return None
    world, me = dist.get_world_size(), dist.get_rank()
    mine = data = None
    for start in range(0, world, size):  # every rank creates every group, in the same order
        group = dist.new_group(list(range(start, start + size)))
        mine = group if start <= me < start + size else mine
    for offset in range(size):
        group = dist.new_group(list(range(offset, world, size)))
        data = group if me % size == offset else data
    return SequenceGroup(group=mine, size=size, rank=me % size, data_group=data)


def check(
    size: int, models: list[nn.Module | None], strategy: Strategy | None, compile: bool, world: int
) -> None:
    """One line for what ``update.sequence_parallel`` = ``size`` cannot run with: DeepSpeed (untested:
    Lightning refuses it on a CPU), ``compile``, a model whose attention cannot be split
    (``check_splittable``), a size that does not divide the ``world`` of trainer ranks."""
    if size == 1:
        return
    if isinstance(strategy, DeepSpeedStrategy) or compile:
        raise ValueError(
            f"update.sequence_parallel={size} runs under DDPStrategy and ModelParallelStrategy (FSDP2), "
            "without compile; allowed values with DeepSpeedStrategy or compile=True: 1"
        )
    if world % size:
        divisors = ", ".join(str(n) for n in range(1, world + 1) if not world % n)
        raise ValueError(
            f"update.sequence_parallel={size} does not divide the {world} trainer ranks; allowed values: "
            f"a divisor of the world size ({divisors})"
        )
    for model in models:
        if model is not None:
            check_splittable(model, size)


def start(
    size: int, models: list[nn.Module | None], strategy: Strategy | None, compile: bool
) -> SequenceGroup | None:
    """This rank's sequence group for ``update.sequence_parallel`` = ``size`` (a collective), once
    ``check`` passes; None for 1."""
    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    check(size, models, strategy, compile, world)
    sequence = sequence_groups(size)
    if sequence is not None:
        # a rank's activations are 1/N of a row's: give the same tensors back to the kernel when freed
        map_large_blocks(MMAP_THRESHOLD_BYTES // size)
        rank_zero_info(
            f"lit-offpolicy: update.sequence_parallel={size}: {world // size} sequence group(s) of {size} "
            f"ranks, each row split {size} ways; each group trains on its ranks' rollouts together"
        )
    return sequence


def joined_experience(exp: Experience, sequence: SequenceGroup, pad_token_id: int) -> Experience:
    """The rollouts of every rank of the group, in rank order, on each of them (responses padded to the
    widest): the group trains on them together, each rank on its share of every row."""
    parts: list[Experience | None] = [None] * sequence.size
    dist.all_gather_object(parts, exp.to("cpu"), group=sequence.group)
    width = max(part.response_ids.shape[1] for part in parts)
    return Experience.cat([part.widened(width, pad_token_id) for part in parts], pad_token_id)


def check_splittable(model: nn.Module, size: int) -> None:
    """One line if ``model``'s attention cannot be split over ``size`` ranks: a family whose attention is
    not plain causal softmax attention through transformers' interface, an attention other than "sdpa",
    or head counts that do not divide (key/value heads may also be a divisor of ``size``)."""
    for module in model.modules():
        config = getattr(module, "config", None)
        if config is None or not hasattr(config, "num_attention_heads"):
            continue
        family = getattr(config, "model_type", None)
        if family not in PER_SAMPLE_MODEL_TYPES:
            raise ValueError(
                f"update.sequence_parallel={size} cannot split the attention of a {family!r} model; allowed "
                f"model families: {', '.join(sorted(PER_SAMPLE_MODEL_TYPES))} (or update.sequence_parallel=1)"
            )
        if config._attn_implementation != "sdpa":
            raise ValueError(
                f"update.sequence_parallel={size} runs the attention as SDPA per sample; allowed values of "
                f"attn_implementation with it: None, 'sdpa' (got {config._attn_implementation!r})"
            )
        heads, kv_heads = config.num_attention_heads, getattr(config, "num_key_value_heads", None) or 0
        kv_heads = kv_heads or heads
        if heads % size or (kv_heads % size and size % kv_heads):
            raise ValueError(
                f"update.sequence_parallel={size} does not divide the model's {heads} attention heads "
                f"({kv_heads} key/value heads); allowed values: a common divisor of the heads, by which "
                "the key/value heads divide or that divides them"
            )


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
