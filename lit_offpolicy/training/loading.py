"""The RL module's models: the actor (with LoRA adapters), the critic, the frozen reference and teacher."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from lit_offpolicy.models import load_actor, load_critic, load_reference, load_tokenizer, require_model_dir
from lit_offpolicy.models.lora import LoraOptions, add_lora
from lit_offpolicy.training.options import DistillOptions

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
"""The parameter dtypes the module loads its models in, by name."""


@dataclass(frozen=True)
class LoadedModels:
    """Actor, critic and reference as loaded, before any sharding or compiling."""

    actor: nn.Module
    """π_θ in train mode: a peft model with LoRA, else the whole causal LM."""
    critic: nn.Module | None
    """A value head on a causal LM backbone; None without ``critic_path``."""
    reference: nn.Module | None
    """π_ref, frozen; None without a KL term or reference path, or where it is the actor unadapted."""
    reference_is_base: bool
    """π_ref is the actor with its LoRA adapters disabled: with LoRA the actor's base weights are
    ``model_path``'s, so no second copy of them is loaded."""


def load_models(
    model_path: str,
    critic_path: str | None,
    reference_path: str | None,
    needs_reference: bool,
    lora: LoraOptions | None,
    dtype: str,
    gradient_checkpointing: bool,
    attn_implementation: str | None,
) -> LoadedModels:
    """Load actor (then its adapters), critic and reference, in this order (the critic's new value head
    and the adapters are drawn from the global RNG); ``needs_reference``: a KL term uses π_ref."""
    torch_dtype, checkpointing, attention = DTYPES[dtype], gradient_checkpointing, attn_implementation
    actor = load_actor(model_path, torch_dtype, checkpointing, attention)
    if lora is not None:
        actor = add_lora(actor, lora)
    critic = load_critic(critic_path, torch_dtype, checkpointing, attention) if critic_path else None
    needs_reference = needs_reference or reference_path is not None
    reference_is_base = needs_reference and lora is not None and reference_path in (None, model_path)
    reference = (
        load_reference(reference_path or model_path, torch_dtype, attention)
        if needs_reference and not reference_is_base
        else None
    )
    return LoadedModels(actor=actor, critic=critic, reference=reference, reference_is_base=reference_is_base)


def load_teacher(
    distill: DistillOptions, student_tokenizer, dtype: str, attn_implementation: str | None
) -> nn.Module | None:
    """On-policy distillation's frozen teacher, ``distill.teacher_path`` (None: distillation is off); it
    scores the student's token ids, so its tokenizer must be the student's (same tokens, same ids)."""
    if not distill.enabled:
        return None
    path = distill.teacher_path
    require_model_dir(path, "distill.teacher_path")
    theirs = load_tokenizer(path).get_vocab()
    mine = student_tokenizer.get_vocab()
    if theirs != mine:
        differing = sorted(
            (token for token in theirs.keys() | mine.keys() if theirs.get(token) != mine.get(token)),
            key=lambda token: (min(theirs.get(token, math.inf), mine.get(token, math.inf)), token),
        )
        examples = ", ".join(
            f"{token!r} ({theirs.get(token, 'none')}, {mine.get(token, 'none')})" for token in differing[:3]
        )
        raise ValueError(
            f"distill.teacher_path={path}: its tokenizer is not the student's ({len(theirs)} tokens against "
            f"model_path's {len(mine)}; tokens whose id differs, as (teacher's id, student's id): "
            f"{examples}); "
            "the teacher scores the student's token ids, so it needs the same vocabulary"
        )
    return load_reference(path, DTYPES[dtype], attn_implementation)
