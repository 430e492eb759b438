"""The environment contract of multi-turn episodes, and the rollout callbacks' ``episodes`` option.

An episode starts from ``Environment.reset(problem)``; the policy then writes a turn, the
environment answers with an :class:`Observation` (a tool's result, a reward or none, whether the
episode is done), and the policy writes its next turn conditioned on everything so far, up to the
limits of :class:`EpisodeConfig`. (The reset/step hook of OpenRLHF's agents and of gym.)
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

from lit_offpolicy.core.checks import check_range
from lit_offpolicy.core.registry import Registry


@dataclass
class Observation:
    """What an environment answers to one turn of the policy."""

    text: str = ""
    """Shown to the policy before its next turn (as a tool message of the chat template); not trained on."""
    reward: float | None = None
    """Added to the episode's score; None: no reward for this turn."""
    done: bool = False
    """The episode ends here (its score then comes from the rewards and the reward function)."""
    tool_calls: int = 0
    """Tool calls the turn made (malformed ones included)."""
    tool_errors: int = 0
    """Of them, those answered with an error: malformed, unknown tool, raised or timed out."""


@dataclass
class EpisodeState:
    """One episode as an environment sees it."""

    problem: dict
    """The data row the episode is on."""
    turns: list[str] = field(default_factory=list)
    """The policy's turns so far, decoded, the latest last."""
    observations: list[str] = field(default_factory=list)
    """The observations the policy was shown, one after each turn but the last."""
    memory: dict[str, Any] = field(default_factory=dict)
    """The environment's own per-episode state."""


class Environment(ABC):
    """Answers the policy's turns. One object serves every episode of a run: per-episode state
    belongs in ``EpisodeState.memory``. ``step`` must not raise on bad input from the policy: it
    answers with an error message as the observation instead."""

    def reset(self, problem: dict) -> str:
        """The text an episode on ``problem`` starts from: by default its prompt as the data module
        rendered it (with the chat template's generation prompt)."""
        return problem["prompt"]

    @abstractmethod
    def step(self, episode: EpisodeState) -> Observation:
        """The answer to the policy's latest turn, ``episode.turns[-1]``."""

    def close(self) -> None:
        """Release what the environment holds (processes, sandboxes); a no-op by default."""
        return None


ENVIRONMENTS: Registry[type[Environment]] = Registry("episodes.environment", Environment)
"""Short names of the environments (``@ENVIRONMENTS.register("name")`` on the class)."""


@dataclass(frozen=True)
class EpisodeConfig:
    """Multi-turn episodes: the rollout callbacks' ``episodes`` option (None: one generation each).

    Every live episode of a step generates together, one turn at a time; an episode leaves the batch
    when its environment says it is done or when it reaches a limit (then it counts as truncated).
    The response of an episode is its turns and observations in order, right-padded to
    ``max_response_tokens``; only the turns are trained on (``Experience.action_mask``).
    """

    environment: Any = "tools"
    """A short name ("tools": ``ToolEnvironment`` with the calculator), an import path
    "pkg.module:Name", or an object given by class_path and init_args."""
    max_turns: int = 4
    """Turns of the policy per episode, at most."""
    max_turn_tokens: int | None = None
    """Tokens of one turn, at most; None: the sampling's ``max_tokens``."""
    max_response_tokens: int = 256
    """Tokens of an episode after its prompt (turns and observations), at most: the response width."""

    def __post_init__(self) -> None:
        check_range("episodes.max_turns", self.max_turns, low=1)
        check_range("episodes.max_response_tokens", self.max_response_tokens, low=1)
        if self.max_turn_tokens is not None:
            check_range("episodes.max_turn_tokens", self.max_turn_tokens, low=1)

    def build(self) -> Environment:
        spec = self.environment
        if hasattr(spec, "as_dict") and not isinstance(spec, Environment):  # a class_path left unbuilt
            spec = spec.as_dict()
        return ENVIRONMENTS.resolve(spec, option="episodes.environment")

    def turn_tokens(self, max_tokens: int) -> int:
        """Tokens one turn may take: ``max_turn_tokens`` (or the sampling's), within the response."""
        return min(self.max_turn_tokens or max_tokens, self.max_response_tokens)
