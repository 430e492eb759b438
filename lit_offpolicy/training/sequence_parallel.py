"""Sequence parallelism's ranks: groups of N that share each packed row, what they refuse, what they train on.

``update.sequence_parallel`` = N: ranks 0 … N − 1, N … 2N − 1, ... are sequence groups; each micro-batch's
row is split across a group (``training.sequence_shard``: the row's shares and Ulysses' attention).
A group trains on its ranks' rollouts together (``joined_experience``), so data parallelism runs over the
groups; the data group (one rank of each sequence group) gathers the batch statistics, so no sample counts
twice. ``check`` refuses, in one line, what cannot be split; ``start`` makes the groups.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist
from lightning.pytorch.strategies import DeepSpeedStrategy, Strategy
from lightning.pytorch.utilities import rank_zero_info
from torch import nn

from lit_offpolicy.core.experience import Experience
from lit_offpolicy.core.memory import MMAP_THRESHOLD_BYTES, map_large_blocks
from lit_offpolicy.training.packed_attention import PER_SAMPLE_MODEL_TYPES


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
    if isinstance(strategy, DeepSpeedStrategy):
        raise ValueError(
            f"update.sequence_parallel={size} runs under DDPStrategy and ModelParallelStrategy (FSDP2), not "
            "DeepSpeedStrategy; allowed values with DeepSpeed: 1"
        )
    if compile:
        raise ValueError(
            f"update.sequence_parallel={size} runs without compile; allowed values with compile=True: 1"
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
            f"ranks, each packed row split {size} ways (padding_free implied); each group trains on its "
            f"ranks' rollouts together: {size} x data.batch_size prompts a step"
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
        heads = config.num_attention_heads
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        if not _splits(heads, kv_heads, size):
            fitting = ", ".join(str(n) for n in range(1, heads + 1) if _splits(heads, kv_heads, n))
            raise ValueError(
                f"update.sequence_parallel={size} does not divide the model's {heads} attention heads "
                f"({kv_heads} key/value heads); allowed values for this model: {fitting}"
            )


def _splits(heads: int, kv_heads: int, size: int) -> bool:
    """N ranks take H/N query heads each, and each key/value head whole, or one per N/H_kv ranks."""
    return heads % size == 0 and (kv_heads % size == 0 or size % kv_heads == 0)
