"""One sampled response, as an engine returns it."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Generation:
    """One sampled response.

    ``token_ids`` includes the eos/stop token when one ended the response; ``log_probs[i]`` is
    log π_rollout of ``token_ids[i]``; ``finish_reason`` is "stop" (eos/stop token) or "length";
    ``versions[i]``, where the engine records it (partial rollouts), is the policy version whose
    weights sampled ``token_ids[i]`` (None: every token was sampled by the engine's version).
    ``action_mask[i]`` is 1 where the policy sampled ``token_ids[i]`` and 0 where the environment
    wrote it (a multi-turn episode's observations, whose ``log_probs`` are 0); None: every token is
    the policy's (what engines return).
    """

    token_ids: list[int]
    log_probs: list[float]
    finish_reason: str
    versions: list[int] | None = None
    action_mask: list[int] | None = None
