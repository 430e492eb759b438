"""One sampled response, as an engine returns it."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Generation:
    """One sampled response of T tokens."""

    token_ids: list[int]
    """[T]: the sampled tokens, with the eos/stop token where one ended the response."""
    log_probs: list[float]
    """[T]: log π_rollout of each token (0 on an environment's tokens)."""
    finish_reason: str
    """Why it ended: "stop" (an eos/stop token) or "length" (the token limit)."""
    versions: list[int] | None = None
    """[T]: the policy version whose weights sampled each token, where the engine records it (partial
    rollouts); None: the engine's version sampled them all."""
    action_mask: list[int] | None = None
    """[T]: 1 where the policy sampled the token, 0 where the environment wrote it (a multi-turn
    episode's observations); None: every token is the policy's (what engines return)."""
