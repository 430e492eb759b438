"""The rollout engine contract: sampling parameters, generations, and the shared log-prob math.

Every engine (HF ``generate``, vLLM) and the trainer's recompute of π_old use ``token_log_probs``,
so "log π_rollout" means the same thing everywhere: the log-softmax of the model's raw logits
divided by the sampling temperature, taken before any top-k/top-p truncation, in float32.
Greedy decoding (temperature 0) reports the log-probs at temperature 1.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch
from torch import Tensor

from lit_offpolicy.checks import check_range


@dataclass(frozen=True)
class SamplingParams:
    """How to sample; the fields map one to one onto ``vllm.SamplingParams``.

    ``temperature=0`` is greedy decoding; ``top_k`` of -1 or 0 and ``top_p=1`` switch truncation off.
    A ``seed`` makes sampling reproducible for the same prompts and parameters.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_tokens: int = 16
    stop_token_ids: tuple[int, ...] = ()
    seed: int | None = None

    def __post_init__(self) -> None:
        check_range("n", self.n, low=1)
        check_range("temperature", self.temperature, low=0.0)
        check_range("top_p", self.top_p, low=0.0, high=1.0, low_inclusive=False)
        check_range("top_k", self.top_k, low=-1)
        check_range("max_tokens", self.max_tokens, low=1)
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@dataclass
class Generation:
    """One sampled response.

    ``token_ids`` includes the eos/stop token when one ended the response; ``log_probs[i]`` is
    log π_rollout of ``token_ids[i]``; ``finish_reason`` is "stop" (eos/stop token) or "length".
    """

    token_ids: list[int]
    log_probs: list[float]
    finish_reason: str


@runtime_checkable
class RolloutEngine(Protocol):
    """Generates responses with a copy of the policy that the trainer refreshes by ``load_weights``."""

    policy_version: int

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[list[Generation]]:
        """``params.n`` generations for each prompt (token ids), in prompt order."""
        ...

    def load_weights(self, state_dict: Mapping[str, Tensor], version: int) -> None:
        """Copy the trainer's weights in and serve them as policy ``version``."""
        ...


def check_prompts(prompts: list[list[int]]) -> None:
    """Raise on an empty prompt: generation needs at least one token to condition on."""
    if any(len(prompt) == 0 for prompt in prompts):
        raise ValueError("prompts must not be empty: generation needs at least one token to condition on")


def token_log_probs(logits: Tensor, token_ids: Tensor, temperature: float = 1.0) -> Tensor:
    """log_softmax(logits / temperature)[token] in float32; temperature 0 (greedy) counts as 1.

    ``logits`` has shape (..., vocab) and ``token_ids`` the leading shape (...); so has the result.
    """
    scaled = logits.float() / (temperature if temperature > 0 else 1.0)
    picked = scaled.gather(-1, token_ids.unsqueeze(-1)).squeeze(-1)
    return picked - torch.logsumexp(scaled, dim=-1)
