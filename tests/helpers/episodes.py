"""A user's environment for multi-turn episodes, importable by class_path:
``helpers.episodes.CountdownEnvironment``."""

from __future__ import annotations

from lit_offpolicy.environments import Environment, EpisodeState, Observation


class CountdownEnvironment(Environment):
    """Answers turn t < ``turns`` with "seen t" and the problem's ``padding`` (one tool call, an error
    on odd turns) and ends the episode at turn ``turns`` with a reward of 0.5."""

    def __init__(self, turns: int = 2) -> None:
        self.turns = turns

    def step(self, episode: EpisodeState) -> Observation:
        turn = len(episode.turns)
        if turn >= self.turns:
            return Observation(reward=0.5, done=True)
        text = f"seen {turn}{episode.problem.get('padding', '')}"
        return Observation(text=text, tool_calls=1, tool_errors=turn % 2)
