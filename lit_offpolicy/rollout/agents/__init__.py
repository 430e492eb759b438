"""Agents as users write them: an OpenAI-compatible endpoint over the rollout engine that records
every token (docs/agents.md)."""

from lit_offpolicy.rollout.agents.config import AgentConfig
from lit_offpolicy.rollout.agents.runner import AgentBatch, AgentCounts, AgentRunner

__all__ = ["AgentBatch", "AgentConfig", "AgentCounts", "AgentRunner"]
