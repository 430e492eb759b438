"""Multi-turn episodes on any rollout engine.

Every live episode generates its next turn together, the environment answers each, and the episodes
that are done or out of room leave the batch.

An episode's response is its turns and the observations between them, in order: turn 1, observation
1, turn 2, ... (no observation after the last turn). The turns are the engine's sampled tokens as
they are (never re-tokenized, so their log-probs stay π_rollout's); an observation is tokenized as a
tool message of the tokenizer's chat template where it has one (the text the template puts between
the assistant's end-of-turn token and the next assistant turn), as ``<tool_response>`` text
otherwise. ``Generation.action_mask`` marks the turns (1) and the observations (0).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from lit_offpolicy.core.generation import Generation
from lit_offpolicy.environments import Environment, EpisodeConfig, EpisodeState
from lit_offpolicy.rewards import RewardInputs
from lit_offpolicy.rollout.engine import RolloutEngine, SamplingParams, WeightSyncHook

TURN_SEED_STRIDE = 7_919
"""Turn t of a step samples with the step's seed + t × this (turn 0 with the step's seed)."""
PLAIN_OBSERVATION = "\n<tool_response>\n{}\n</tool_response>\n"
"""An observation's text for a tokenizer without a chat template."""
_PROBE = [{"role": "user", "content": "?"}, {"role": "assistant", "content": "!"}]


def observation_text(tokenizer, text: str, chat: bool) -> str:
    """``text`` as the chat template writes a tool message after an assistant turn, from just after
    the turn's end-of-turn token up to the next assistant turn's opening; ``PLAIN_OBSERVATION``
    without a template (``chat`` False)."""
    if not chat:
        return PLAIN_OBSERVATION.format(text)
    before = tokenizer.apply_chat_template(_PROBE, tokenize=False)
    after = tokenizer.apply_chat_template(
        [*_PROBE, {"role": "tool", "content": text}], tokenize=False, add_generation_prompt=True
    )
    if not after.startswith(before):
        raise ValueError("the tokenizer's chat template rewrites earlier turns when a tool message follows")
    eos = tokenizer.eos_token or ""
    cut = before.rfind(eos) + len(eos) if eos and eos in before else len(before)
    return after[cut:]


@dataclass
class EpisodeCounts:
    """What the ``env/*`` metrics count over a batch of episodes."""

    episodes: int = 0
    """Episodes run."""
    turns: int = 0
    """Turns of the policy, over all episodes."""
    tool_calls: int = 0
    """Tool calls the policy made (malformed ones included)."""
    tool_errors: int = 0
    """Of them, those answered with an error: malformed, unknown tool, raised or timed out."""
    truncated: int = 0
    """Episodes ended by a limit (turns or tokens), not by the environment."""

    def __add__(self, other: EpisodeCounts) -> EpisodeCounts:
        return EpisodeCounts(
            *(a + b for a, b in zip(dataclasses.astuple(self), dataclasses.astuple(other), strict=True))
        )

    def metrics(self) -> dict[str, float]:
        """``env/turns_mean``, ``env/tool_calls_mean`` (per episode), ``env/tool_error_fraction`` (of
        the tool calls) and ``env/truncated_fraction`` (episodes ended by a limit, not by the environment)."""
        episodes = max(self.episodes, 1)
        return {
            "env/turns_mean": self.turns / episodes,
            "env/tool_calls_mean": self.tool_calls / episodes,
            "env/tool_error_fraction": self.tool_errors / max(self.tool_calls, 1),
            "env/truncated_fraction": self.truncated / episodes,
        }


@dataclass
class EpisodeBatch:
    """The episodes of a batch of prompts, ``n`` per prompt in prompt order."""

    prompt_ids: list[list[int]]
    """Per prompt, the token ids of its opening (``environment.reset``)."""
    generations: list[list[Generation]]
    """Per prompt, its n episodes as generations (turns and observations, ``action_mask`` set)."""
    completions: list[str]
    """Per episode (flat), its last turn's text: what the reward function scores."""
    completion_ids: list[list[int]]
    """Per episode (flat), its last turn's token ids."""
    rewards: list[float]
    """Per episode (flat), the sum of the environment's rewards (0 where it gave none)."""
    counts: EpisodeCounts
    """What the ``env/*`` metrics count over the batch."""


@dataclass
class _Episode:
    """One episode being run; its response so far is T tokens, turns and observations."""

    state: EpisodeState
    """What the environment sees (the problem, the turns' and observations' texts)."""
    prompt: list[int]
    """The opening's token ids."""
    tokens: list[int] = field(default_factory=list)
    """[T]: the response so far."""
    log_probs: list[float] = field(default_factory=list)
    """[T]: log π_rollout of each turn token; 0 on observations."""
    versions: list[int] = field(default_factory=list)
    """[T]: the policy version of each token (an observation takes its turn's)."""
    actions: list[int] = field(default_factory=list)
    """[T]: 1 on turn tokens, 0 on observation tokens (``Generation.action_mask``)."""
    last_turn: list[int] = field(default_factory=list)
    """The last turn's token ids: what the reward function scores."""
    reward: float = 0.0
    """The sum of the environment's rewards so far."""
    finish_reason: str | None = None
    """Why it ended: "stop" (the environment said done) or "length" (truncated); None: running."""

    def add(self, tokens: list[int], log_probs: list[float], versions: list[int], action: int) -> None:
        self.tokens += tokens
        self.log_probs += log_probs
        self.versions += versions
        self.actions += [action] * len(tokens)


class EpisodeRunner:
    """Runs ``config``'s episodes with ``environment``; ``chat``: observations as the tokenizer's chat
    template writes a tool message (see the module docstring)."""

    def __init__(self, environment: Environment, config: EpisodeConfig, tokenizer, chat: bool) -> None:
        self.environment = environment
        self.config = config
        self.tokenizer = tokenizer
        self.chat = chat

    def run(
        self,
        engine: RolloutEngine,
        problems: list[dict],
        params: SamplingParams,
        add_special_tokens: bool = True,
        sync: WeightSyncHook | None = None,
    ) -> EpisodeBatch:
        """``params.n`` episodes per problem, started from ``environment.reset(problem)``."""
        openings = [self.environment.reset(problem) for problem in problems]
        prompt_ids = self.tokenizer(openings, add_special_tokens=add_special_tokens).input_ids
        episodes = [
            _Episode(EpisodeState(problem=dict(problem)), list(prompt))
            for problem, prompt in zip(problems, prompt_ids, strict=True)
            for _ in range(params.n)
        ]
        counts = EpisodeCounts(episodes=len(episodes))
        live, turn = episodes, 0
        while live:
            turn_params = self._turn_params(params, live, turn)
            if turn == 0:  # the n episodes of a prompt share its first generate (and its prompt cache)
                generated = [g for group in _generate(engine, prompt_ids, turn_params, sync) for g in group]
            else:
                contexts = [episode.prompt + episode.tokens for episode in live]
                generated = [group[0] for group in _generate(engine, contexts, turn_params, sync)]
            counts.turns += len(live)
            for episode, generation in zip(live, generated, strict=True):
                self._take_turn(episode, generation, engine.policy_version, turn + 1, counts)
            live = [episode for episode in live if episode.finish_reason is None]
            turn += 1
        counts.truncated = sum(episode.finish_reason == "length" for episode in episodes)
        n = params.n
        flat = [
            Generation(e.tokens, e.log_probs, e.finish_reason, e.versions, action_mask=e.actions)
            for e in episodes
        ]
        return EpisodeBatch(
            prompt_ids=prompt_ids,
            generations=[flat[i : i + n] for i in range(0, len(flat), n)],
            completions=[self.tokenizer.decode(e.last_turn, skip_special_tokens=True) for e in episodes],
            completion_ids=[e.last_turn for e in episodes],
            rewards=[e.reward for e in episodes],
            counts=counts,
        )

    def episode_scores(
        self, engine: RolloutEngine, problems, params, reward_fn, add_special_tokens=True
    ) -> list[float]:
        """One score per episode (``params.n`` per problem, in order): the reward function's on its
        last turn plus the environment's rewards (validation)."""
        batch = self.run(engine, problems, params, add_special_tokens)
        inputs = RewardInputs.of(problems, batch.completions, batch.completion_ids, params.n)
        return [score + bonus for score, bonus in zip(reward_fn(inputs).scores, batch.rewards, strict=True)]

    def _turn_params(self, params: SamplingParams, live: list[_Episode], turn: int) -> SamplingParams:
        """Turn 0: ``params`` with the turn's token limit; later turns: one sample per episode, seeded
        ``TURN_SEED_STRIDE`` apart, up to the room the roomiest live episode has left."""
        limit = self.config.turn_tokens(params.max_tokens)
        room = max(self.config.max_response_tokens - len(episode.tokens) for episode in live)
        changes = {"max_tokens": min(limit, room)}
        if turn > 0:
            changes["n"] = 1
            if params.seed is not None:
                changes["seed"] = params.seed + turn * TURN_SEED_STRIDE
        return dataclasses.replace(params, **changes)

    def _take_turn(
        self, episode: _Episode, generation: Generation, version: int, turns: int, counts: EpisodeCounts
    ) -> None:
        """Append the turn, let the environment answer, and either end the episode or append the
        observation. A turn cut short by the episode's room ends it, truncated, unanswered; a final
        turn keeps the engine's finish reason (so a one-turn episode is the engine's generation)."""
        room = self.config.max_response_tokens - len(episode.tokens)
        tokens, log_probs = generation.token_ids[:room], generation.log_probs[:room]
        versions = (generation.versions or [version] * len(generation.token_ids))[:room]
        episode.add(tokens, log_probs, versions, action=1)
        episode.last_turn = list(tokens)
        if len(generation.token_ids) > room:
            episode.finish_reason = "length"
            return
        episode.state.turns.append(self.tokenizer.decode(tokens, skip_special_tokens=True))
        answer = self.environment.step(episode.state)
        counts.tool_calls += answer.tool_calls
        counts.tool_errors += answer.tool_errors
        episode.reward += answer.reward or 0.0
        if answer.done:
            episode.finish_reason = generation.finish_reason
            return
        observation = self.tokenizer(
            observation_text(self.tokenizer, answer.text, self.chat), add_special_tokens=False
        ).input_ids
        # the next turn needs at least one token of room after the observation
        if (
            turns >= self.config.max_turns
            or len(episode.tokens) + len(observation) >= self.config.max_response_tokens
        ):
            episode.finish_reason = "length"
            return
        episode.state.observations.append(answer.text)
        last_version = episode.versions[-1] if episode.versions else version
        episode.add(observation, [0.0] * len(observation), [last_version] * len(observation), action=0)


def _generate(engine: RolloutEngine, prompts, params: SamplingParams, sync: WeightSyncHook | None):
    if sync is None:
        return engine.generate(prompts, params)
    return engine.generate(prompts, params, sync=sync)
