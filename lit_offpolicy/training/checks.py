"""Checks of the RL module's options that no option group can make alone, before any model is loaded."""

from __future__ import annotations

import torch

from lit_offpolicy.advantages import GAE, Advantage
from lit_offpolicy.core.checks import check_choice, check_range
from lit_offpolicy.correction import RolloutCorrection
from lit_offpolicy.losses import PPO, PolicyLoss, Vanilla
from lit_offpolicy.training.loading import DTYPES


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
