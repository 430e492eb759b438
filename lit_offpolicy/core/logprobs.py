"""The log-prob convention that engines and the trainer share.

Every engine (HF ``generate``, vLLM) and the trainer's recompute of π_old use ``token_log_probs``,
so "log π_rollout" means the same thing everywhere: the log-softmax of the model's raw logits
divided by the sampling temperature, taken before any top-k/top-p truncation, in float32.
Greedy decoding (temperature 0) reports the log-probs at temperature 1.
"""

from __future__ import annotations

import torch
from torch import Tensor


def at_least_float32(logits: Tensor) -> Tensor:
    """``logits`` in float32, or float64 if they are float64 (a float64 model keeps its precision)."""
    return logits if logits.dtype == torch.float64 else logits.float()


def token_log_probs(logits: Tensor, token_ids: Tensor, temperature: float = 1.0) -> Tensor:
    """log_softmax(logits / temperature)[token] in float32 (float64 for float64 logits).

    Temperature 0 (greedy) counts as 1.

    ``logits`` has shape (..., vocab) and ``token_ids`` the leading shape (...); so has the result.
    """
    scaled = at_least_float32(logits) / (temperature if temperature > 0 else 1.0)
    picked = scaled.gather(-1, token_ids.unsqueeze(-1)).squeeze(-1)
    return picked - torch.logsumexp(scaled, dim=-1)
