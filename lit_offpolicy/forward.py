"""Teacher-forced passes over an Experience: the policy's log-probs and entropy, the critic's values."""

from __future__ import annotations

import inspect

import torch
from torch import Tensor, nn

from lit_offpolicy.experience import Experience
from lit_offpolicy.losses import entropy_from_logits
from lit_offpolicy.rollout.engine import token_log_probs


def position_ids(attention_mask: Tensor) -> Tensor:
    """Positions that skip left padding, as ``generate`` assigns them: 0 at each row's first real token."""
    return (attention_mask.cumsum(dim=-1) - 1).clamp(min=0)


def _forward(model: nn.Module, exp: Experience, **kwargs):
    attention_mask = exp.attention_mask
    return model(
        input_ids=exp.input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids(attention_mask),
        use_cache=False,
        **kwargs,
    )


def _at_response(per_position: Tensor, exp: Experience) -> Tensor:
    """The positions that predict each response token: P − 1 … P + R − 2 of the prompt+response input."""
    prompt_len, response_len = exp.prompt_ids.shape[1], exp.response_ids.shape[1]
    return per_position[:, prompt_len - 1 : prompt_len + response_len - 1]


def response_logits(model: nn.Module, exp: Experience) -> Tensor:
    """The logits at the positions that predict the response tokens, (B, R, V).

    A Hugging Face causal LM is asked for its last R + 1 positions only (``logits_to_keep``): the LM
    head and its B × L × V output, the largest activation of a step for a real vocabulary, then cover
    the response instead of prompt + response. The last kept position predicts past the response and
    is dropped. A model without ``logits_to_keep`` returns every position and is sliced.
    """
    if _accepts_logits_to_keep(model):
        response_len = exp.response_ids.shape[1]
        return _forward(model, exp, logits_to_keep=response_len + 1).logits[:, :-1]
    return _at_response(_forward(model, exp).logits, exp)


def _accepts_logits_to_keep(model: nn.Module) -> bool:
    return "logits_to_keep" in inspect.signature(model.forward).parameters


def policy_log_probs(
    model: nn.Module, exp: Experience, temperature: float, with_entropy: bool = False
) -> tuple[Tensor, Tensor | None]:
    """log π(response token | prefix) at ``temperature`` (the engines' convention), and the entropy."""
    logits = response_logits(model, exp)
    log_probs = token_log_probs(logits, exp.response_ids, temperature)
    if not with_entropy:
        return log_probs, None
    scaled = logits.float() / (temperature if temperature > 0 else 1.0)
    return log_probs, entropy_from_logits(scaled)


def critic_values(critic: nn.Module, exp: Experience) -> Tensor:
    """V(prefix) for the state before each response token (the critic returns one value per position)."""
    return _at_response(_forward(critic, exp), exp).float()


@torch.no_grad()
def frozen_log_probs(model: nn.Module, exp: Experience, temperature: float, micro_batch_size: int) -> Tensor:
    """log-probs without gradient, ``micro_batch_size`` samples at a time."""
    parts = [policy_log_probs(model, part, temperature)[0] for part in exp.split(micro_batch_size)]
    return torch.cat(parts)
