"""Cross-rank collectives: world size and rank, row gathers, sums, minima and metric reductions.

Every function works in a single process too (then it is the identity, or the plain computation), so
the module and callbacks call them unconditionally. Collectives go through ``torch.distributed``:
every rank must call them in the same order (docs/architecture.md, "Data-parallel RL").
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from lightning.pytorch.strategies import DeepSpeedStrategy, ModelParallelStrategy, Strategy
from torch import Tensor

from lit_offpolicy.core.memory import PEAK_METRICS

# a rank's sampling seed is seed + rl_step + rank * RANK_SEED_STRIDE: ranks never share a seed
# for runs shorter than this many RL steps
RANK_SEED_STRIDE = 1_000_003


def world_size() -> int:
    """Number of processes in the default group (1 without ``torch.distributed``)."""
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def rank() -> int:
    """This process's rank in the default group (0 without ``torch.distributed``)."""
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def destroy_process_group() -> None:
    """End the default process group if it spans several processes, before the interpreter exits.

    Lightning leaves it open after ``fit``. At exit gloo's worker threads may then still hold work
    with tensors whose destruction needs the already finalized interpreter, and the process dies with
    SIGABRT ("terminate called without an active exception", pytorch/pytorch#190489). Every rank calls
    this once, after its last collective. A one-process group is left alone: it is the in-process vLLM
    engine's, which later engines in the same process reuse.
    """
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.destroy_process_group()


PEER_GONE = ("Connection closed by peer", "Connection reset by peer")
"""What gloo's collectives raise when another process of the group has ended."""


def peer_gone(error: BaseException) -> str | None:
    """Where ``error`` is a collective failing because another rank's process ended (killed, or failed
    first): gloo's reason, the part of its message after its source location; otherwise None."""
    message = str(error)
    if not isinstance(error, RuntimeError) or not any(phrase in message for phrase in PEER_GONE):
        return None
    return message.split("] ", 1)[-1].split(". ", 1)[0]


def gather_rows(
    *tensors: Tensor | None, group: dist.ProcessGroup | None = None
) -> tuple[list[Tensor | None], slice]:
    """Concatenate each tensor's rows (dim 0) over all ranks, in rank order, and say where ours are;
    ``group``: over its ranks only.

    The tensors are one batch (the same number of rows on a rank). Ranks may hold different numbers
    of rows and, beyond dim 0, different sizes (e.g. response widths): a rank's rows are zero-padded
    to the largest shape for the collective and cut back to the row count after, so a row narrower
    than the widest is zero-filled (its mask there is 0). ``None`` stays ``None``. Returns the
    gathered tensors and the slice of them that holds this rank's rows.
    """
    present = [i for i, t in enumerate(tensors) if t is not None]
    count = len(tensors[present[0]]) if present else 0
    if (world_size() if group is None else dist.get_world_size(group)) == 1 or not present:
        return list(tensors), slice(0, count)
    ndim = max(tensors[i].dim() for i in present)
    shapes = torch.zeros(len(present), ndim, dtype=torch.long, device=tensors[present[0]].device)
    for k, i in enumerate(present):
        shapes[k, : tensors[i].dim()] = torch.tensor(tensors[i].shape)
    all_shapes = _all_gather(shapes, group)  # (world, tensors present, ndim)
    counts = all_shapes[:, 0, 0].tolist()
    start = sum(counts[: dist.get_rank(group)])
    gathered: list[Tensor | None] = [None] * len(tensors)
    for k, i in enumerate(present):
        tensor = tensors[i]
        largest = all_shapes[:, k, : tensor.dim()].amax(dim=0).tolist()
        padded = tensor.new_zeros(largest)
        padded[tuple(slice(0, size) for size in tensor.shape)] = tensor
        parts = _all_gather(padded, group)
        gathered[i] = torch.cat([part[:n] for part, n in zip(parts, counts, strict=True)])
    return gathered, slice(start, start + count)


def _all_gather(tensor: Tensor, group: dist.ProcessGroup | None = None) -> Tensor:
    """(ranks, *tensor.shape): every rank's tensor (all must have the same shape and dtype), of ``group``."""
    parts = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, tensor.contiguous(), group=group)
    return torch.stack(parts)


def sum_over_ranks(values: list[float], device: torch.device | str = "cpu") -> list[float]:
    """Element-wise sums of ``values`` over the ranks (one ``all_reduce``); the values themselves in
    one process. Every rank passes a list of the same length."""
    if world_size() == 1:
        return list(values)
    total = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(total, op=dist.ReduceOp.SUM)
    return total.tolist()


def min_over_ranks(value: int, device: torch.device | str = "cpu") -> int:
    """The smallest of every rank's ``value`` (one ``all_reduce``); ``value`` itself in one process."""
    return _reduce_int(value, dist.ReduceOp.MIN, device) if world_size() > 1 else int(value)


def max_over_ranks(value: int, device: torch.device | str = "cpu") -> int:
    """The largest of every rank's ``value`` (one ``all_reduce``); ``value`` itself in one process."""
    return _reduce_int(value, dist.ReduceOp.MAX, device) if world_size() > 1 else int(value)


def max_over_ranks_each(values: list[int], device: torch.device | str = "cpu") -> list[int]:
    """Element-wise maxima of ``values`` over the ranks (one ``all_reduce``); the values themselves in
    one process. Every rank passes a list of the same length."""
    if world_size() == 1:
        return [int(value) for value in values]
    reduced = torch.tensor(values, dtype=torch.long, device=device)
    dist.all_reduce(reduced, op=dist.ReduceOp.MAX)
    return reduced.tolist()


def from_rank_zero(value):
    """Rank 0's ``value`` (any picklable object) on every rank, by one ``broadcast_object_list``;
    ``value`` itself in one process."""
    if world_size() == 1:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def barrier() -> None:
    """Return once every rank has called it (at once in one process)."""
    if world_size() > 1:
        dist.barrier()


def gather_objects(value) -> list:
    """Every rank's ``value`` (picklable), in rank order, by one ``all_gather_object``."""
    if world_size() == 1:
        return [value]
    values = [None] * world_size()
    dist.all_gather_object(values, value)
    return values


def _reduce_int(value: int, op, device: torch.device | str) -> int:
    reduced = torch.tensor([value], dtype=torch.long, device=device)
    dist.all_reduce(reduced, op=op)
    return int(reduced.item())


def reduce_metrics(metrics: dict[str, float], device: torch.device | str = "cpu") -> dict[str, float]:
    """Each metric reduced over the ranks that logged it: max for names ending in ``_max`` and for the
    peak-memory figures (``memory.PEAK_METRICS``), min for ``_min``, mean otherwise. One
    ``all_gather_object`` of the names (ranks may log different sets) and one ``all_reduce`` per
    reduction; identical results on every rank.
    """
    if world_size() == 1:
        return dict(metrics)
    names_per_rank: list[list[str]] = [[] for _ in range(world_size())]
    dist.all_gather_object(names_per_rank, sorted(metrics))
    names = sorted(set().union(*names_per_rank))
    kinds = {name: _reduction(name) for name in names}
    reduced: dict[str, float] = {}
    for kind, fill in (("mean", 0.0), ("max", -float("inf")), ("min", float("inf"))):
        selected = [name for name in names if kinds[name] == kind]
        if not selected:
            continue
        values = torch.tensor(
            [metrics.get(name, fill) for name in selected], dtype=torch.float64, device=device
        )
        if kind == "mean":
            counts = torch.tensor(
                [float(name in metrics) for name in selected], dtype=torch.float64, device=device
            )
            both = torch.stack([values, counts])
            dist.all_reduce(both, op=dist.ReduceOp.SUM)
            values = both[0] / both[1]
        else:
            dist.all_reduce(values, op=dist.ReduceOp.MAX if kind == "max" else dist.ReduceOp.MIN)
        reduced.update(zip(selected, values.tolist(), strict=True))
    return reduced


def _reduction(name: str) -> str:
    if name.endswith("_max") or name in PEAK_METRICS:
        return "max"
    if name.endswith("_min"):
        return "min"
    return "mean"


def params_sharded(strategy: Strategy | None) -> bool:
    """True where a rank holds only a shard of each parameter (FSDP2, DeepSpeed ZeRO-3)."""
    if isinstance(strategy, ModelParallelStrategy):
        return True
    return isinstance(strategy, DeepSpeedStrategy) and strategy.zero_stage_3
