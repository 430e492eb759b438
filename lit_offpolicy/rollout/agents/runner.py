"""AgentRunner: runs the user's agent on a batch of rows, ``n`` episodes each, against the endpoint.

The agents run as tasks of an asyncio loop in a thread of their own (``concurrency`` at once, each
cancelled at ``timeout_s``); the calling thread, which owns the engine, serves their calls in batches
meanwhile. An episode's branches (``transcript``) become its samples, in the group of its row.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import inspect
import threading
from collections.abc import Callable
from dataclasses import dataclass

from lit_offpolicy.core.generation import Generation
from lit_offpolicy.rewards import RewardInputs, RewardOutput
from lit_offpolicy.rollout.agents.batching import GenerationQueue
from lit_offpolicy.rollout.agents.config import AgentConfig
from lit_offpolicy.rollout.agents.endpoint import AgentEndpoint, Session
from lit_offpolicy.rollout.agents.transcript import Transcript
from lit_offpolicy.rollout.engine import RolloutEngine, SamplingParams, WeightSyncHook


@dataclass
class AgentCounts:
    """What the ``agent/*`` metrics count over a batch of episodes."""

    episodes: int = 0
    calls: int = 0
    """Calls answered with a generation."""
    rejected_calls: int = 0
    """Calls answered with a 4xx error (parameters, budget, ``max_calls``)."""
    tool_calls: int = 0
    samples: int = 0
    """Branches over all episodes (an episode with no call counts one, empty)."""
    failed: int = 0
    """Episodes whose agent raised or returned something other than a number or None."""
    timed_out: int = 0
    """Episodes cancelled at ``timeout_s``."""
    handed_to_reward: int = 0
    """Episodes whose agent returned None (scored by the reward function)."""
    batches: int = 0
    """The engine's ``generate`` calls."""

    def __add__(self, other: AgentCounts) -> AgentCounts:
        return AgentCounts(
            *(a + b for a, b in zip(dataclasses.astuple(self), dataclasses.astuple(other), strict=True))
        )

    def metrics(self) -> dict[str, float]:
        episodes = max(self.episodes, 1)
        return {
            "agent/calls_mean": self.calls / episodes,
            "agent/rejected_calls_mean": self.rejected_calls / episodes,
            "agent/tool_calls_mean": self.tool_calls / episodes,
            "agent/samples_per_episode": self.samples / episodes,
            "agent/failed_fraction": self.failed / episodes,
            "agent/timeout_fraction": self.timed_out / episodes,
            "agent/reward_fn_fraction": self.handed_to_reward / episodes,
            "agent/calls_per_generate": self.calls / max(self.batches, 1),
        }


@dataclass
class Episode:
    """One run of the agent on one row."""

    row: int
    """The index of its problem in the batch."""
    session: Session
    reward: float | None = None
    """What the agent returned (None: the reward function scores it)."""
    failure: str | None = None
    """Why it failed ("raised ...", "timed out ..."); None: it returned."""
    timed_out: bool = False


@dataclass
class AgentBatch:
    """The samples of a batch of episodes (one per branch), with their episodes' scores."""

    prompt_ids: list[list[int]]
    """Per sample, its prompt's token ids."""
    generations: list[Generation]
    """Per sample, its response (``action_mask`` set)."""
    groups: list[int]
    """Per sample, the index of its row (its group)."""
    scores: list[float]
    """Per sample, its episode's score."""
    rewards: RewardOutput
    """Per sample: the scores and what the reward function and the agent left unscored."""
    counts: AgentCounts
    completions: list[str]
    """Per sample, its episode's last reply."""
    episode_scores: list[float]
    """Per episode (``n`` per row, in order), its score."""


class AgentRunner:
    """Serves the endpoint (from :meth:`start` to :meth:`close`) and runs the agent's episodes."""

    def __init__(self, config: AgentConfig, tokenizer) -> None:
        self.config = config
        self.agent = config.build()
        self.takes_client = "client" in inspect.signature(self.agent).parameters
        self.asynchronous = inspect.iscoroutinefunction(self.agent)
        self.tokenizer = tokenizer
        self.queue = GenerationQueue()
        self.endpoint: AgentEndpoint | None = None
        self._cancel: Callable[[], object] = lambda: None
        """Cancels the running episodes (set by the agents' loop while it runs)."""

    def start(self) -> None:
        if self.endpoint is None:
            config = self.config
            self.endpoint = AgentEndpoint(
                self.tokenizer, self.queue, config.model_name, config.host, config.port, config.timeout_s
            )

    def close(self) -> None:
        if self.endpoint is not None:
            self.endpoint.shutdown()
            self.endpoint = None

    def run(
        self,
        engine: RolloutEngine,
        problems: list[dict],
        params: SamplingParams,
        reward_fn: Callable[[RewardInputs], RewardOutput],
        add_special_tokens: bool = True,
        sync: WeightSyncHook | None = None,
        training: bool = True,
    ) -> AgentBatch:
        """``params.n`` episodes per problem, their calls served by ``engine`` from this thread.
        ``training`` False (validation): a request's temperature, top_p and top_k are not checked
        against ``params`` (nothing trains on the samples), and ``params`` sample them."""
        self.start()
        config = self.config
        episodes = []
        for row in range(len(problems)):
            for _ in range(params.n):
                transcript = Transcript(self.tokenizer, config.max_prompt_tokens, config.max_response_tokens)
                session = self.endpoint.open(
                    transcript, params, config.call_tokens(params.max_tokens), config.max_calls, training
                )
                episodes.append(Episode(row, session))
        batches_before = self.queue.batches
        done = threading.Event()
        thread = threading.Thread(
            target=self._run_agents, args=(episodes, problems, done), name="agents", daemon=True
        )
        thread.start()
        try:
            self.queue.serve(engine, done.is_set, sync)
        except BaseException as error:  # the engine failed, or the run is stopping: end the episodes now
            self._cancel_agents()
            self.queue.fail_waiting(error)
            raise
        finally:
            done.wait()
            thread.join()
            for episode in episodes:
                self.endpoint.close(episode.session)
        return self._batch(
            episodes, problems, reward_fn, add_special_tokens, self.queue.batches - batches_before
        )

    def episode_scores(
        self, engine, problems, params, reward_fn, add_special_tokens: bool = True
    ) -> list[float]:
        """One score per episode (``params.n`` per problem, in order): validation."""
        batch = self.run(engine, problems, params, reward_fn, add_special_tokens, training=False)
        return batch.episode_scores

    # the agents' thread

    def _run_agents(self, episodes: list[Episode], problems: list[dict], done: threading.Event) -> None:
        try:
            asyncio.run(self._all(episodes, problems))
        finally:
            done.set()
            self.queue.wake()

    async def _all(self, episodes: list[Episode], problems: list[dict]) -> None:
        import httpx

        limit = asyncio.Semaphore(self.config.concurrency)
        connections = httpx.Limits(
            max_connections=self.config.concurrency, max_keepalive_connections=self.config.concurrency
        )

        async def one(episode: Episode) -> None:
            async with limit:
                self.queue.add_running(1)
                try:
                    await self._episode(episode, _agent_row(problems[episode.row]), http)
                finally:
                    self.endpoint.close(episode.session)  # its calls from now on get a 401
                    self.queue.add_running(-1)

        async with httpx.AsyncClient(limits=connections, timeout=self.config.timeout_s) as http:
            everything = asyncio.gather(*(one(episode) for episode in episodes))
            self._cancel = lambda: everything.get_loop().call_soon_threadsafe(everything.cancel)
            with contextlib.suppress(asyncio.CancelledError):
                await everything

    def _cancel_agents(self) -> None:
        """Cancel every episode still running (from another thread)."""
        with contextlib.suppress(RuntimeError):  # the agents' loop has already closed
            self._cancel()

    async def _episode(self, episode: Episode, row: dict, http) -> None:
        timeout = self.config.timeout_s
        try:
            result = await asyncio.wait_for(self._call(episode.session, row, http), timeout)
        except TimeoutError:
            episode.failure, episode.timed_out = f"did not finish within agent.timeout_s={timeout}", True
            return
        except Exception as error:  # the user's code: any failure scores the episode as failed
            episode.failure = f"raised {type(error).__name__}: {error}"
            return
        if result is not None and (isinstance(result, bool) or not isinstance(result, (int, float))):
            episode.failure = f"returned {type(result).__name__}; expected a number (the reward) or None"
            return
        episode.reward = None if result is None else float(result)

    async def _call(self, session: Session, row: dict, http):
        base_url, key, asynchronous = self.endpoint.base_url, session.key, self.asynchronous
        if not self.takes_client:
            kwargs = {"base_url": base_url, "api_key": key, "row": row}
            return await self.agent(**kwargs) if asynchronous else await _in_thread(self.agent, kwargs)
        import openai

        options = {"base_url": base_url, "api_key": key, "max_retries": 0, "timeout": self.config.timeout_s}
        if asynchronous:  # the episodes' clients share one connection pool (``http``)
            return await self.agent(client=openai.AsyncOpenAI(**options, http_client=http), row=row)
        with openai.OpenAI(**options) as client:
            return await _in_thread(self.agent, {"client": client, "row": row})

    # packing

    def _batch(self, episodes, problems, reward_fn, add_special_tokens: bool, batches: int) -> AgentBatch:
        counts = AgentCounts(episodes=len(episodes), batches=batches)
        prompt_ids, generations, groups, owners = [], [], [], []
        for index, episode in enumerate(episodes):
            session, transcript = episode.session, episode.session.transcript
            counts.calls += len(transcript.calls)
            counts.rejected_calls += session.rejected
            counts.tool_calls += session.tool_calls
            counts.failed += episode.failure is not None and not episode.timed_out
            counts.timed_out += episode.timed_out
            counts.handed_to_reward += episode.failure is None and episode.reward is None
            branches = transcript.branches
            if branches:
                samples = [(b.prompt, b.generation()) for b in branches]
            else:  # no call answered: the row's prompt and an empty response, which trains nothing
                prompt = self.tokenizer(
                    problems[episode.row]["prompt"], add_special_tokens=add_special_tokens
                ).input_ids
                samples = [(prompt, Generation([], [], "stop", [], []))]
            for prompt, generation in samples:
                prompt_ids.append(list(prompt))
                generations.append(generation)
                groups.append(episode.row)
                owners.append(index)
        counts.samples = len(generations)
        per_episode = self._score(episodes, problems, reward_fn)
        rewards = _per_sample(per_episode, owners)
        completions = [episodes[i].session.transcript.last_reply_text for i in owners]
        return AgentBatch(
            prompt_ids, generations, groups, rewards.scores, rewards, counts, completions, per_episode.scores
        )

    def _score(self, episodes: list[Episode], problems, reward_fn) -> RewardOutput:
        """Per episode: the agent's number, the reward function's score (None returned), or 0 (failed,
        and unscored: a step whose every episode failed counts toward ``reward.max_failed_steps``)."""
        label = f"agent {self.config.name}"
        asked = [i for i, e in enumerate(episodes) if e.failure is None and e.reward is None]
        scores = [e.reward if e.reward is not None else 0.0 for e in episodes]
        by_function = {label: [e.reward for e in episodes]}
        failure = next((f"{label} {e.failure}" for e in episodes if e.failure is not None), None)
        if not asked:
            return RewardOutput(scores, num_malformed=0, by_function=by_function, first_error=failure)
        transcripts = [episodes[i].session.transcript for i in asked]
        scored = reward_fn(
            RewardInputs.of(
                [problems[episodes[i].row] for i in asked],
                [t.last_reply_text for t in transcripts],
                [t.branches[-1].last_reply if t.branches else [] for t in transcripts],
            )
        )
        for position, index in enumerate(asked):
            scores[index] = scored.scores[position]
        for name, values in scored.by_function.items():
            by_function[name] = [None] * len(episodes)
            for position, index in enumerate(asked):
                by_function[name][index] = values[position]
        return dataclasses.replace(
            scored, scores=scores, by_function=by_function, first_error=failure or scored.first_error
        )


def _per_sample(output: RewardOutput, owners: list[int]) -> RewardOutput:
    """``output`` (one entry per episode) repeated for each of its samples."""
    return dataclasses.replace(
        output,
        scores=[output.scores[i] for i in owners],
        by_function={name: [values[i] for i in owners] for name, values in output.by_function.items()},
    )


def _agent_row(problem: dict) -> dict:
    """What the agent gets: the row's columns, its ``prompt`` as the row held it and its ``answer``."""
    return {
        **problem.get("columns", {}),
        "prompt": problem.get("raw_prompt", problem["prompt"]),
        "answer": problem.get("answer"),
    }


async def _in_thread(fn, kwargs: dict):
    """``fn(**kwargs)`` in a daemon thread: one that hangs past its time-out is left behind, never joined."""
    loop = asyncio.get_running_loop()
    result = loop.create_future()

    def settle(setter, value) -> None:
        if not result.done():
            setter(value)

    def target() -> None:
        try:
            value = fn(**kwargs)
        except BaseException as error:  # handed to the awaiting task
            _call_soon(loop, settle, result.set_exception, error)
        else:
            _call_soon(loop, settle, result.set_result, value)

    threading.Thread(target=target, daemon=True).start()
    return await result


def _call_soon(loop, *args) -> None:
    with contextlib.suppress(RuntimeError):  # the loop has closed: the episode timed out long ago
        loop.call_soon_threadsafe(*args)
