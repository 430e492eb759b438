"""Checks of the RL module's options that no option group can make alone, before any model is loaded."""

from __future__ import annotations

import math

import lightning as L
import torch

from lit_offpolicy.advantages import GAE, Advantage
from lit_offpolicy.core.checks import check_choice, check_range
from lit_offpolicy.correction import RolloutCorrection
from lit_offpolicy.losses import PPO, PolicyLoss, Vanilla
from lit_offpolicy.training.loading import DTYPES
from lit_offpolicy.training.options import UpdateOptions


def check_options(
    dtype: str,
    max_consecutive_nonfinite: int,
    padding_free: bool,
    compile: bool,
    attn_implementation: str | None,
    logprob_chunk_size: int | None,
) -> None:
    """A known ``dtype``; at least one non-finite step before stopping; ``padding_free`` and ``compile``
    booleans; an attention that separates packed samples by their positions where they are packed;
    ``logprob_chunk_size`` a number of tokens ≥ 1 or None."""
    check_choice("dtype", dtype, tuple(DTYPES))
    check_range("max_consecutive_nonfinite", max_consecutive_nonfinite, low=1)
    check_choice("padding_free", padding_free, (True, False))
    check_choice("compile", compile, (True, False))
    if padding_free and attn_implementation == "flex_attention":
        raise ValueError(
            "padding_free=True needs an attention that separates packed samples by their positions; "
            "allowed values of attn_implementation with it: None, 'eager', 'sdpa', 'flash_attention_2'"
        )
    chunk = logprob_chunk_size
    if chunk is not None and (isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1):
        raise ValueError(
            f"logprob_chunk_size={chunk!r} is not a number of tokens; allowed values: an integer ≥ 1 "
            "(tokens per LM-head chunk) or None (the whole (B, R, V) logits at once)"
        )


def check_components(
    advantage: Advantage, policy_loss: PolicyLoss, correction: RolloutCorrection, critic_path: str | None
) -> None:
    """GAE needs a critic; pure-IS correction replaces the policy loss, so only PPO or Vanilla (whose
    ``loss_agg_mode`` alone is used) may come with it."""
    if isinstance(advantage, GAE) and critic_path is None:
        raise ValueError(
            "advantage=GAE needs a critic: set critic_path (e.g. to model_path) or use GRPO/RLOO"
        )
    if correction.pure_is and type(policy_loss) not in (PPO, Vanilla):
        raise ValueError(
            f"rollout_correction in pure-IS mode replaces the policy loss by off-policy REINFORCE; "
            f"policy_loss={type(policy_loss).__name__} would be ignored: use PPO or Vanilla "
            "(only its loss_agg_mode is used) or turn pure_is off"
        )


def check_attention_device(attn_implementation: str | None, device: torch.device) -> None:
    """FlexAttention trains on CUDA only: torch has no backward for it on CPU."""
    if attn_implementation == "flex_attention" and device.type != "cuda":
        raise ValueError(
            "attn_implementation='flex_attention' trains on CUDA only (torch's FlexAttention has no "
            "backward on CPU); allowed values on CPU: None, 'eager', 'sdpa'"
        )


def check_token_budget(
    budget: int | None, max_prompt_length: int, response_option: str, response_tokens: int
) -> None:
    """A micro-batch token budget (``update.max_tokens_per_micro_batch``) that holds the longest sample
    the run can produce, ``data.max_prompt_length`` + the longest response, checked before the first step."""
    longest = max_prompt_length + response_tokens
    if budget is not None and budget < longest:
        raise ValueError(
            f"update.max_tokens_per_micro_batch={budget} is smaller than the longest possible sample: "
            f"data.max_prompt_length={max_prompt_length} + {response_option}={response_tokens} = {longest} "
            f"tokens; set it to at least {longest} (or lower those options)"
        )


def optimizer_steps_per_rl_step(update: UpdateOptions, samples: int) -> int:
    """The optimizer steps (``trainer.global_step``) one RL step of ``samples`` samples per rank makes at
    most: ``update.ppo_epochs`` × its mini-batches (fewer where dynamic sampling ends short)."""
    size = min(update.mini_batch_size or samples, samples)
    return update.ppo_epochs * math.ceil(samples / max(size, 1))


class CheckpointMismatch(ValueError):
    """A checkpoint whose weights belong to other components than the run's (``check_ckpt``)."""


def check_ckpt(checkpoint: dict, module: L.LightningModule) -> None:
    """Refuse, in one line, a checkpoint whose weights are of other components than ``module``'s (a
    critic, a reference, LoRA adapters, another actor): another algorithm's config. Resuming needs the
    same components; the actor's weights alone load through ``model_path`` (an ``HFExport`` directory).
    Checkpoints without a ``state_dict`` (DeepSpeed's, sharded ones) and ``strict_loading=False`` pass."""
    saved = checkpoint.get("state_dict")
    if saved is None or not module.strict_loading:
        return
    own = set(module.state_dict(keep_vars=True))
    lora = any("lora_" in key for key in own.symmetric_difference(saved))
    only_saved, only_own = _components(set(saved) - own, lora), _components(own - set(saved), lora)
    if not only_saved and not only_own:
        return
    differences = [f"the checkpoint has {', '.join(only_saved)} this run has not"] if only_saved else []
    differences += [f"this run has {', '.join(only_own)} the checkpoint has not"] if only_own else []
    path = getattr(module._trainer, "ckpt_path", None) if module._trainer is not None else None
    raise CheckpointMismatch(
        f"--ckpt_path {path or ''}: another configuration's checkpoint ({'; '.join(differences)}); "
        "--ckpt_path resumes a run with the same model options (algorithm, critic_path, kl, lora); to "
        "start from its actor's weights only, leave --ckpt_path out and set model.init_args.model_path to "
        "that run's HFExport directory (e.g. outputs/actor)"
    )


def _components(keys: set[str], lora: bool) -> list[str]:
    """The components that weight names belong to: critic, reference, LoRA adapters, actor weights;
    ``lora``: adapters on one side only, which also rename the actor's base weights (not listed then)."""
    found = [
        name
        for prefix, name in (
            ("critic.", "a critic"),
            ("reference.", "a reference model"),
            ("teacher.", "a teacher"),
        )
        if any(key.startswith(prefix) for key in keys)
    ]
    if any("lora_" in key for key in keys):
        found.append("LoRA adapters")
    elif not lora and any(key.startswith("actor.") for key in keys):
        found.append("other actor weights")
    if keys and not found and not lora:
        found.append("other weights")
    return found
