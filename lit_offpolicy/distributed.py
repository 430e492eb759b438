"""Data-parallel RL helpers: cross-rank gathers and metric reductions, gradient clipping through the
strategy and FSDP2 sharding (the actor's full weights for the engine sync: ``weight_sync``).

Every function works in a single process too (then it is the identity, or the plain computation), so
the module and callbacks call them unconditionally. Collectives go through ``torch.distributed``:
every rank must call them in the same order (docs/architecture.md, "Data-parallel RL").
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from lightning.pytorch.strategies import DeepSpeedStrategy, FSDPStrategy, ModelParallelStrategy, Strategy
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from lit_offpolicy.compiling import transformer_blocks
from lit_offpolicy.memory import PEAK_METRICS

# the LightningModule attributes that hold models; FSDP2 shards each of them
MODEL_ATTRIBUTES = ("actor", "critic", "reference")

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
    with tensors whose destruction needs the already finalised interpreter, and the process dies with
    SIGABRT ("terminate called without an active exception", pytorch/pytorch#190489). Every rank calls
    this once, after its last collective. A one-process group is left alone: it is the in-process vLLM
    engine's, which later engines in the same process reuse.
    """
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.destroy_process_group()


def gather_rows(*tensors: Tensor | None) -> tuple[list[Tensor | None], slice]:
    """Concatenate each tensor's rows (dim 0) over all ranks, in rank order, and say where ours are.

    The tensors are one batch (the same number of rows on a rank). Ranks may hold different numbers
    of rows and, beyond dim 0, different sizes (e.g. response widths): a rank's rows are zero-padded
    to the largest shape for the collective and cut back to the row count after, so a row narrower
    than the widest is zero-filled (its mask there is 0). ``None`` stays ``None``. Returns the
    gathered tensors and the slice of them that holds this rank's rows.
    """
    present = [i for i, t in enumerate(tensors) if t is not None]
    count = len(tensors[present[0]]) if present else 0
    if world_size() == 1 or not present:
        return list(tensors), slice(0, count)
    ndim = max(tensors[i].dim() for i in present)
    shapes = torch.zeros(len(present), ndim, dtype=torch.long, device=tensors[present[0]].device)
    for k, i in enumerate(present):
        shapes[k, : tensors[i].dim()] = torch.tensor(tensors[i].shape)
    all_shapes = _all_gather(shapes)  # (world, tensors present, ndim)
    counts = all_shapes[:, 0, 0].tolist()
    start = sum(counts[: rank()])
    gathered: list[Tensor | None] = [None] * len(tensors)
    for k, i in enumerate(present):
        tensor = tensors[i]
        largest = all_shapes[:, k, : tensor.dim()].amax(dim=0).tolist()
        padded = tensor.new_zeros(largest)
        padded[tuple(slice(0, size) for size in tensor.shape)] = tensor
        parts = _all_gather(padded)
        gathered[i] = torch.cat([part[:n] for part, n in zip(parts, counts, strict=True)])
    return gathered, slice(start, start + count)


def _all_gather(tensor: Tensor) -> Tensor:
    """(world, *tensor.shape): every rank's tensor (all must have the same shape and dtype)."""
    parts = [torch.empty_like(tensor) for _ in range(world_size())]
    dist.all_gather(parts, tensor.contiguous())
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


# ----------------------------------------------------------------- strategies


def check_strategy(strategy: Strategy | None) -> None:
    """Refuse ``FSDPStrategy`` (FSDP1): it finalises gradients only for a loss computed from the root
    module's output, which a manual-optimisation step with several backwards never has."""
    if isinstance(strategy, FSDPStrategy):
        raise ValueError(
            "trainer.strategy=FSDPStrategy (FSDP1) is not supported by OffPolicyModule: its several "
            "backward passes per step bypass FSDP1's root module; allowed values: ModelParallelStrategy "
            "(FSDP2, configs/strategy/fsdp.yaml), DDPStrategy, DeepSpeedStrategy"
        )


def params_sharded(strategy: Strategy | None) -> bool:
    """True where a rank holds only a shard of each parameter (FSDP2, DeepSpeed ZeRO-3)."""
    if isinstance(strategy, ModelParallelStrategy):
        return True
    return isinstance(strategy, DeepSpeedStrategy) and strategy.zero_stage_3


def shard_fsdp2(strategy: Strategy | None, pl_module: nn.Module) -> None:
    """Under ``ModelParallelStrategy``: FSDP2 (``fully_shard``) over all ranks, one unit per transformer
    block (a class named ``*DecoderLayer``, as Llama, Qwen, Mistral... name theirs) and one per model
    (actor, critic, reference: the frozen reference is sharded too). Idempotent.

    The mesh is one dimension over every rank (full sharding); Lightning's own 2-D mesh (nodes x
    devices, meant for tensor parallelism) is not used. Each unit gathers its parameters in its own
    forward and frees them after, so the step's many forward/backward passes (π_old, reference,
    micro-batches) each find the parameters they use.
    """
    if not isinstance(strategy, ModelParallelStrategy):
        return
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = None
    for attribute in MODEL_ATTRIBUTES:
        model = getattr(pl_module, attribute, None)
        if model is None or any(isinstance(p, DTensor) for p in model.parameters()):
            continue
        mesh = mesh or init_device_mesh(strategy.root_device.type, (strategy.world_size,))
        for block in transformer_blocks(model):
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)


def clip_grad_norm(
    strategy: Strategy | None, parameters: list[nn.Parameter], max_norm: float
) -> Tensor | None:
    """Clip the global gradient norm to ``max_norm`` the way the strategy needs; return the norm before
    (a 0-dim tensor on the gradients' device).

    DDP / one device: ``clip_grad_norm_`` on the (already all-reduced) gradients. FSDP2: the same
    call on the sharded (DTensor) gradients, which reduces the norm over the shards. DeepSpeed: the
    engine clips inside its step (``gradient_clipping`` in its config, see :func:`configure_deepspeed`)
    and the norm is not known before the step: None.
    """
    if isinstance(strategy, DeepSpeedStrategy):
        return None
    norm = torch.nn.utils.clip_grad_norm_(parameters, max_norm)
    return norm.full_tensor() if isinstance(norm, DTensor) else norm


def configure_deepspeed(strategy: Strategy | None, max_grad_norm: float | None) -> None:
    """Settings DeepSpeed's engine needs for the module's manual optimisation; the config's own win.

    ``gradient_clipping`` = ``max_grad_norm`` (0: off): the engine clips inside its step. A config
    value that differs raises (two clipping norms would be ambiguous). With ZeRO stage ≥ 2,
    ``managed_gradient_accumulation: false``: the module's several micro-batch backwards accumulate
    and its ``optimizer.step()`` is the boundary where gradients are reduced and applied (DeepSpeed's
    managed mode would treat every backward as a boundary, since Lightning sets
    ``gradient_accumulation_steps`` to 1). Call before the strategy builds its engine
    (``LightningModule.setup``).
    """
    if not isinstance(strategy, DeepSpeedStrategy) or not isinstance(strategy.config, dict):
        return
    wanted = float(max_grad_norm or 0.0)
    configured = strategy.config.setdefault("gradient_clipping", wanted)
    if float(configured) != wanted:
        raise ValueError(
            f"DeepSpeed config gradient_clipping={configured} differs from the module's "
            f"max_grad_norm={max_grad_norm}; allowed values: the same norm in both, or leave "
            "gradient_clipping out of the DeepSpeed config"
        )
    if strategy.config.get("zero_optimization", {}).get("stage", 0) >= 2:
        strategy.config.setdefault("managed_gradient_accumulation", False)
