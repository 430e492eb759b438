"""Environments of multi-turn episodes: the contract, the registry and the built-in tool environment."""

from lit_offpolicy.environments.base import (
    ENVIRONMENTS,
    Environment,
    EpisodeConfig,
    EpisodeState,
    Observation,
)
from lit_offpolicy.environments.calculator import calculator
from lit_offpolicy.environments.tools import (
    TOOLS,
    ToolCall,
    ToolEnvironment,
    call_with_timeout,
    parse_tool_calls,
)

__all__ = [
    "ENVIRONMENTS",
    "TOOLS",
    "Environment",
    "EpisodeConfig",
    "EpisodeState",
    "Observation",
    "ToolCall",
    "ToolEnvironment",
    "calculator",
    "call_with_timeout",
    "parse_tool_calls",
]
