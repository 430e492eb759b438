"""The actor's full weights for the engine sync and the export, gathered and streamed in buckets.

A sync used to gather the whole state dict and hand it over in one piece: under FSDP2 or ZeRO-3 every
rank then held a second, unsharded copy of the model beside its shard. Here the state dict is cut into
buckets of about ``bucket_bytes`` (by the full, unsharded sizes), each bucket is gathered when the
consumer reaches it, and dropped once consumed, so a rank holds at most one bucket of gathered weights
beyond its shard (verl's and slime's weight sync work the same way).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import nullcontext
from typing import TYPE_CHECKING

from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from lit_offpolicy.models.lora import has_adapters, lora_scaling, merge_lora_stream

if TYPE_CHECKING:  # Lightning is imported where a strategy is given: vLLM's processes import this package
    from lightning.pytorch.strategies import Strategy

DEFAULT_BUCKET_MB = 512
"""``Rollout(sync_bucket_mb=...)``'s default."""
DEFAULT_BUCKET_BYTES = DEFAULT_BUCKET_MB * 2**20


def stream_full_weights(
    strategy: Strategy | None,
    pl_module: nn.Module,
    attribute: str = "actor",
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
) -> Iterator[tuple[str, Tensor]]:
    """The full (unsharded) weights of ``pl_module.<attribute>``, one ``(name, tensor)`` at a time.

    With Hugging Face names, for the engine sync (``RolloutEngine.load_weights``); for a LoRA actor,
    its adapters merged into the base weights (``lora.merge_lora_stream``).

    Lazy: nothing is gathered until the consumer iterates. Under FSDP2 and ZeRO-3 the gathers are
    collectives, so every rank must consume the stream to its end, in the same order.
    """
    module: nn.Module = getattr(pl_module, attribute)
    items = (item for bucket in gathered_buckets(strategy, module, bucket_bytes) for item in bucket)
    return merge_lora_stream(items, lora_scaling(module)) if has_adapters(module) else items


def full_state_dict(
    strategy: Strategy | None, pl_module: nn.Module, attribute: str = "actor"
) -> dict[str, Tensor]:
    """``stream_full_weights`` collected into one dict (the async producer's snapshot, tests)."""
    return dict(stream_full_weights(strategy, pl_module, attribute))


def gathered_state_dict(strategy: Strategy | None, module: nn.Module) -> dict[str, Tensor]:
    """The full (unsharded) state dict of ``module`` on every rank (``gathered_buckets`` joined)."""
    return {name: tensor for bucket in gathered_buckets(strategy, module) for name, tensor in bucket}


def gathered_buckets(
    strategy: Strategy | None, module: nn.Module, bucket_bytes: int = DEFAULT_BUCKET_BYTES
) -> Iterator[list[tuple[str, Tensor]]]:
    """``module``'s state dict in buckets of at most ``bucket_bytes``, each gathered when it is reached.

    A bucket holds consecutive entries; a larger tensor is a bucket of its own.

    DDP, ZeRO-1/2 and one device hold full parameters: the buckets hold the state dict's own tensors
    (no copy). FSDP2: each ``DTensor`` of the bucket is gathered (``full_tensor``) and copied to CPU.
    ZeRO-3: the bucket's partitioned parameters are gathered together (one ``GatheredParameters``) and
    copied to CPU. A collective under FSDP2 and ZeRO-3: every rank must take every bucket.
    """
    from lightning.pytorch.strategies import DeepSpeedStrategy, ModelParallelStrategy

    zero3 = isinstance(strategy, DeepSpeedStrategy) and strategy.zero_stage_3
    state = module.state_dict(keep_vars=zero3)
    for names in _bucket_names(state, bucket_bytes):
        if isinstance(strategy, ModelParallelStrategy):
            yield [(name, _full(state[name]).detach().cpu()) for name in names]
        elif zero3:
            yield _gathered_zero3([(name, state[name]) for name in names])
        else:
            yield [(name, state[name]) for name in names]


def _full(tensor: Tensor) -> Tensor:
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def _gathered_zero3(bucket: list[tuple[str, Tensor]]) -> list[tuple[str, Tensor]]:
    import deepspeed

    partitioned = [tensor for _, tensor in bucket if hasattr(tensor, "ds_id")]
    gathered = deepspeed.zero.GatheredParameters(partitioned, modifier_rank=None) if partitioned else None
    with gathered or nullcontext():
        return [(name, tensor.detach().cpu().clone()) for name, tensor in bucket]


def _bucket_names(state: dict[str, Tensor], bucket_bytes: int) -> Iterator[list[str]]:
    bucket: list[str] = []
    size = 0
    for name, tensor in state.items():
        nbytes = full_numel(tensor) * tensor.element_size()
        if bucket and size + nbytes > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append(name)
        size += nbytes
    if bucket:
        yield bucket


def full_numel(tensor: Tensor) -> int:
    """Elements of the unsharded tensor: a ``DTensor``'s global shape, a ZeRO-3 partition's ``ds_numel``."""
    return int(getattr(tensor, "ds_numel", tensor.numel()))


def buckets_of(pairs: Iterable[tuple[str, Tensor]], bucket_bytes: int) -> Iterator[list[tuple[str, Tensor]]]:
    """``(name, tensor)`` pairs regrouped into buckets of at most ``bucket_bytes`` (a larger tensor is a
    bucket of its own), lazily: a bucket is yielded as soon as it is full."""
    bucket: list[tuple[str, Tensor]] = []
    size = 0
    for name, tensor in pairs:
        nbytes = tensor.numel() * tensor.element_size()
        if bucket and size + nbytes > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, tensor))
        size += nbytes
    if bucket:
        yield bucket
