"""The rollout callbacks' ``agent`` option: a user's agent program trained through the endpoint."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from lit_offpolicy.core.checks import check_range
from lit_offpolicy.core.registry import import_object


@dataclass(frozen=True)
class AgentConfig:
    """Each sample is an episode of the user's agent, which calls the policy through an
    OpenAI-compatible endpoint the run serves (docs/agents.md).

    The agent is a function of the data row, given by import path, e.g.
    ``async def solve(client: openai.AsyncOpenAI, row: dict) -> float | None`` (a client made for the
    episode), or ``def solve(base_url: str, api_key: str, row: dict)`` for any HTTP client; sync or
    async. A number it returns is the episode's reward; None hands the episode's last reply to the
    reward function (``reward.fn``).
    """

    fn: Any = None
    """The agent: an import path "pkg.module:name" (or the function itself)."""
    concurrency: int = 32
    """Episodes that run at once."""
    max_calls: int = 8
    """Calls an episode may make; the next gets an HTTP 429."""
    timeout_s: float = 60.0
    """Seconds an episode may run; then it is cancelled and scores as failed."""
    max_call_tokens: int | None = None
    """Tokens one call may sample, at most; None: ``sampling.max_tokens``."""
    max_prompt_tokens: int = 512
    """Tokens of an episode's first prompt (and of any prompt that starts a branch), at most."""
    max_response_tokens: int = 256
    """Tokens of an episode after its first prompt (replies and what the agent adds), at most: the
    response width of a sample."""
    host: str = "127.0.0.1"
    """The address the endpoint listens on (loopback: agents on this machine only)."""
    port: int = 0
    """Its port; 0: a free one (each trainer rank serves its own endpoint)."""
    model_name: str = "policy"
    """The model name requests must name (``/v1/models`` lists it)."""

    def __post_init__(self) -> None:
        if self.fn is None or (isinstance(self.fn, str) and not self.fn.strip()):
            raise ValueError('agent.fn is required: an import path "pkg.module:name" to your agent function')
        check_range("agent.concurrency", self.concurrency, low=1)
        check_range("agent.max_calls", self.max_calls, low=1)
        check_range("agent.timeout_s", self.timeout_s, low=0.0, low_inclusive=False)
        check_range("agent.max_prompt_tokens", self.max_prompt_tokens, low=1)
        check_range("agent.max_response_tokens", self.max_response_tokens, low=1)
        check_range("agent.port", self.port, low=0, high=65535)
        if self.max_call_tokens is not None:
            check_range("agent.max_call_tokens", self.max_call_tokens, low=1)

    @property
    def name(self) -> str:
        return self.fn if isinstance(self.fn, str) else getattr(self.fn, "__qualname__", repr(self.fn))

    def build(self) -> Callable[..., Any]:
        """The agent function, checked to take ``row`` and either ``client`` or ``base_url`` and
        ``api_key``; a ValueError naming ``agent.fn`` otherwise."""
        fn = import_object(self.fn, "agent.fn") if isinstance(self.fn, str) else self.fn
        if not callable(fn):
            raise ValueError(f"agent.fn={self.name!r} is not a function")
        parameters = inspect.signature(fn).parameters
        takes = set(parameters)
        if "row" not in takes or not ({"client"} <= takes or {"base_url", "api_key"} <= takes):
            raise ValueError(
                f"agent.fn={self.name!r} takes ({', '.join(parameters)}); expected (client, row) or "
                "(base_url, api_key, row)"
            )
        return fn

    def call_tokens(self, max_tokens: int) -> int:
        return min(self.max_call_tokens or max_tokens, self.max_response_tokens)
