"""The RL module's optimizer and learning-rate schedule: AdamW over actor (and critic), stepped per
optimizer step."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from lit_offpolicy.training.options import OptimOptions


def optimizer_and_schedule(
    actor: nn.Module,
    critic: nn.Module | None,
    options: OptimOptions,
    total_steps: int | None,
    wrapped: bool = False,
) -> dict[str, Any]:
    """AdamW with a parameter group for the actor's trainable weights (lr) and one for the critic's
    (``critic_lr`` or lr), and a ``LambdaLR`` of ``lr_factor``, in Lightning's
    ``configure_optimizers`` form; ``total_steps``: the run's optimizer steps (None: unknown).
    ``wrapped``: a strategy (DeepSpeed) steps the optimizer on tensors of its own (``fused_applies``)."""
    groups = [{"params": [p for p in actor.parameters() if p.requires_grad], "lr": options.lr}]
    if critic is not None:
        groups.append({"params": list(critic.parameters()), "lr": options.critic_lr or options.lr})
    fused = not wrapped and fused_applies([p for group in groups for p in group["params"]])
    optimizer = torch.optim.AdamW(groups, weight_decay=options.weight_decay, fused=fused or None)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor(options, total_steps))
    return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def fused_applies(parameters: list[nn.Parameter]) -> bool:
    """AdamW's fused kernel for parameters that are all plain floating-point tensors on CUDA or the CPU
    (not FSDP2's DTensors, nor on another device).

    The fused kernel updates each weight and its two moments in place. The defaults hold temporaries:
    on CUDA ``foreach`` steps all parameters at once with a temporary as large as them (√v̂ of every
    weight: 2.9 GiB for Qwen2.5-1.5B in bfloat16; our peak there was 2.3 GiB above TRL's, which runs
    transformers' ``adamw_torch_fused``); on the CPU the per-parameter loop holds two temporaries of
    one parameter, 2 × 297 MiB for the LM head of a 151,936-token vocabulary at hidden 512, which was
    the peak of an update at that shape (``benchmarks/peers/memory_vs_trl.py``)."""
    return bool(parameters) and all(
        p.device.type in ("cuda", "cpu") and p.is_floating_point() and not isinstance(p.data, DTensor)
        for p in parameters
    )


def lr_factor(options: OptimOptions, total_steps: int | None) -> Callable[[int], float]:
    """The learning rate's factor at each optimizer step: linear warm-up, then constant, linear or cosine
    decay to ``min_lr_ratio`` at ``total_steps``.

    With w = ``warmup_steps``, p = min(1, (step − w) / max(1, total_steps − w)) and m = ``min_lr_ratio``:
    (step + 1) / w while step < w; then 1 ("constant", or no ``total_steps``), or m + (1 − m)·d with
    d = 1 − p ("linear") or d = ½(1 + cos(π p)) ("cosine", Loshchilov & Hutter 2017, SGDR).
    """
    o = options

    def factor(step: int) -> float:
        if step < o.warmup_steps:
            return (step + 1) / o.warmup_steps
        if o.lr_schedule == "constant" or not total_steps:
            return 1.0
        progress = min(1.0, (step - o.warmup_steps) / max(1, total_steps - o.warmup_steps))
        decay = 1.0 - progress if o.lr_schedule == "linear" else 0.5 * (1.0 + math.cos(math.pi * progress))
        return o.min_lr_ratio + (1.0 - o.min_lr_ratio) * decay

    return factor
