"""Lightning strategies under the module's manual optimization: the FSDP1 refusal, FSDP2 sharding,
gradient clipping through the strategy and DeepSpeed's settings."""

from __future__ import annotations

import torch
from lightning.pytorch.strategies import DeepSpeedStrategy, FSDPStrategy, ModelParallelStrategy, Strategy
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from lit_offpolicy.training.compiling import transformer_blocks

# the LightningModule attributes that hold models; FSDP2 shards each of them
MODEL_ATTRIBUTES = ("actor", "critic", "reference", "teacher")


def check_strategy(strategy: Strategy | None) -> None:
    """Refuse ``FSDPStrategy`` (FSDP1): it finalizes gradients only for a loss computed from the root
    module's output, which a manual-optimization step with several backwards never has."""
    if isinstance(strategy, FSDPStrategy):
        raise ValueError(
            "trainer.strategy=FSDPStrategy (FSDP1) is not supported by OffPolicyModule: its several "
            "backward passes per step bypass FSDP1's root module; allowed values: ModelParallelStrategy "
            "(FSDP2, configs/strategy/fsdp.yaml), DDPStrategy, DeepSpeedStrategy"
        )


def shard_fsdp2(strategy: Strategy | None, pl_module: nn.Module) -> None:
    """Under ``ModelParallelStrategy``: FSDP2 (``fully_shard``) over all ranks. Idempotent.

    One unit per transformer block (a class named ``*DecoderLayer``, as Llama, Qwen, Mistral... name
    theirs) and one per model (actor, critic, reference, teacher: the frozen ones are sharded too).

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
    """Clip the global gradient norm to ``max_norm`` the way the strategy needs; the norm before.

    The norm: a 0-dim tensor on the gradients' device.

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
    """Settings DeepSpeed's engine needs for the module's manual optimization; the config's own win.

    ``gradient_clipping`` = ``max_grad_norm`` (0: off): the engine clips inside its step; a config
    value that differs raises (two clipping norms would be ambiguous). With ZeRO stage ≥ 2,
    ``managed_gradient_accumulation: false``: the module's micro-batch backwards accumulate and its
    ``optimizer.step()`` is where gradients are reduced and applied. Call before the strategy builds
    its engine (``LightningModule.setup``).
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
    # DeepSpeed's managed mode would take every backward for a boundary: Lightning sets its
    # gradient_accumulation_steps to 1
    if strategy.config.get("zero_optimization", {}).get("stage", 0) >= 2:
        strategy.config.setdefault("managed_gradient_accumulation", False)
