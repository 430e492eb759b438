"""A step's sampling rounds: which problems a round samples, with which seed, and the step's result.

Round 0 samples the step's batch of prompts. With DAPO's dynamic sampling (``filter_groups`` and
``max_sampling_rounds`` > 1; ``rollout.filtering``) later rounds sample training problems drawn at
random until the step holds its batch's number of informative groups. ``RolloutWorker.rollout`` runs
the rounds with these helpers; ``assemble`` turns them into one ``RolloutResult``.
"""

from __future__ import annotations

import dataclasses
import functools
import operator
import random
import time
from collections.abc import Callable, Sequence

import torch

from lit_offpolicy.core.distributed import RANK_SEED_STRIDE
from lit_offpolicy.core.experience import Experience
from lit_offpolicy.core.masked import masked_count
from lit_offpolicy.core.records import RolloutResult
from lit_offpolicy.rewards import (
    RewardInputs,
    RewardOutput,
    count_metrics,
    function_metrics,
    unscored_fraction,
)
from lit_offpolicy.rollout.agents import AgentCounts, AgentRunner
from lit_offpolicy.rollout.engine import RolloutEngine, SamplingParams, WeightSyncHook
from lit_offpolicy.rollout.episodes import EpisodeCounts, EpisodeRunner
from lit_offpolicy.rollout.filtering import (
    ROUND_GROWTH_LIMIT,
    PromptHistory,
    draw_problems,
    informative_samples,
)

ROUND_SEED_STRIDE = 100_003
"""Sampling seeds of a step's re-sampling rounds are this far apart (ranks: ``RANK_SEED_STRIDE``)."""


@dataclasses.dataclass
class Round:
    """One sampling round of a step, scored and packed, before any filtering (B samples)."""

    experience: Experience
    """The round's B = problems × n samples, packed prompt-major."""
    rewards: RewardOutput
    """The reward function's output: B scores (before the environment's rewards) and failure counts."""
    finished: list[bool]
    """Per sample (B): whether the engine stopped it (finish reason "stop") rather than a limit."""
    texts: list[str]
    """Per problem: its first sample, readable (prompt → response, answer, score)."""
    generate_seconds: float
    """Seconds the engine (or the episodes) took."""
    reward_seconds: float
    """Seconds the reward function took."""
    informative: torch.Tensor | None
    """[B] bool: whether the sample's group has unequal rewards; None unless groups are filtered."""
    samples_per_group: int
    """n, the samples per problem."""
    episodes: EpisodeCounts | AgentCounts | None
    """Multi-turn or agent episodes: what the ``env/*`` or ``agent/*`` metrics count; None: one
    generation per sample."""

    @property
    def informative_groups(self) -> int:
        return int(self.informative.sum()) // self.samples_per_group


def first_group_id(step: int, rank: int, world_size: int, target: int, max_sampling_rounds: int) -> int:
    """The first group id of a step's samples on a rank. Ids are unique over steps and ranks: each
    (step, rank) numbers a block as large as its rounds can sample (``ROUND_GROWTH_LIMIT``)."""
    stride = target * (1 + ROUND_GROWTH_LIMIT * (max_sampling_rounds - 1))
    return (step * world_size + rank) * stride


def round_params(
    sampling: SamplingParams, seed: int | None, step: int, rank: int, round_index: int
) -> SamplingParams:
    """``sampling`` seeded for one round: seed + step + rank × ``RANK_SEED_STRIDE`` + round ×
    ``ROUND_SEED_STRIDE``; unchanged where ``seed`` (the run's) is None."""
    if seed is None:
        return sampling
    seed += step + rank * RANK_SEED_STRIDE + round_index * ROUND_SEED_STRIDE
    return dataclasses.replace(sampling, seed=seed)


def round_problems(
    batch: list[dict],
    count: int,
    round_index: int,
    *,
    train_problems: Sequence[dict],
    history: PromptHistory | None,
    key: str,
) -> list[dict]:
    """The problems one round samples: the step's batch in round 0, ``count`` training problems drawn
    at random in the others. Under ``pre_rollout_filter`` (``history``): the batch's problems that
    pass the filter, then drawn problems that pass it, up to ``count``. ``key`` seeds the draws."""
    if history is None:
        return batch if round_index == 0 else draw_problems(train_problems, count, f"resample/{key}")
    rng = random.Random(f"pre-rollout/{key}")
    kept = history.select(batch, rng) if round_index == 0 else []
    return kept + history.draw(train_problems, count - len(kept), rng)


def sample_round(
    engine: RolloutEngine,
    reward_fn: Callable[[RewardInputs], RewardOutput],
    tokenizer,
    problems: list[dict],
    params: SamplingParams,
    *,
    special_tokens: bool,
    first_group: int,
    filter_groups: bool,
    runner: EpisodeRunner | None = None,
    sync_hook: WeightSyncHook | None = None,
) -> Round:
    """Sample ``params.n`` responses to each problem's prompt (or episodes, with ``runner``), score
    them and pack them, unfiltered; the groups are numbered from ``first_group``."""
    prompts = [problem["prompt"] for problem in problems]
    started = time.perf_counter()
    episodes = None
    if runner is None:
        prompt_ids = tokenizer(list(prompts), add_special_tokens=special_tokens).input_ids
        # an engine without partial rollouts need not take a ``sync`` argument
        if sync_hook is None:
            generations = engine.generate(prompt_ids, params)
        else:
            generations = engine.generate(prompt_ids, params, sync=sync_hook)
        completion_ids = [g.token_ids for group in generations for g in group]
        responses = [tokenizer.decode(ids, skip_special_tokens=True) for ids in completion_ids]
        width, extra = params.max_tokens, [0.0] * len(responses)
    else:
        batch = runner.run(engine, problems, params, special_tokens, sync_hook)
        prompt_ids, generations, episodes = batch.prompt_ids, batch.generations, batch.counts
        responses, completion_ids = batch.completions, batch.completion_ids
        width, extra = runner.config.max_response_tokens, batch.rewards
    generate_seconds = time.perf_counter() - started
    inputs = RewardInputs.of(problems, responses, completion_ids, params.n)
    started = time.perf_counter()
    rewards: RewardOutput = reward_fn(inputs)
    reward_seconds = time.perf_counter() - started
    scores = [score + bonus for score, bonus in zip(rewards.scores, extra, strict=True)]
    experience = Experience.from_generations(
        prompt_ids,
        generations,
        scores,
        pad_token_id=tokenizer.pad_token_id,
        policy_version=engine.policy_version,
        temperature=params.temperature,
        group_offset=first_group,
        response_width=width,
    )
    texts = [
        f"{prompts[i // params.n]!r} → {responses[i]!r} "
        f"(answer {problems[i // params.n]['answer']!r}, score {scores[i]})"
        for i in range(0, len(responses), params.n)
    ]
    finished = [g.finish_reason == "stop" for group in generations for g in group]
    informative = informative_samples(experience.scores, experience.group_ids) if filter_groups else None
    return Round(
        experience,
        rewards,
        finished,
        texts,
        generate_seconds,
        reward_seconds,
        informative,
        samples_per_group=params.n,
        episodes=episodes,
    )


def sample_agent_round(
    engine: RolloutEngine,
    reward_fn: Callable[[RewardInputs], RewardOutput],
    runner: AgentRunner,
    problems: list[dict],
    params: SamplingParams,
    *,
    special_tokens: bool,
    first_group: int,
    sync_hook: WeightSyncHook | None = None,
) -> Round:
    """``params.n`` episodes of the user's agent per problem (``runner``), scored and packed: one
    sample per branch of an episode, in its problem's group (so a group may hold more than n)."""
    started = time.perf_counter()
    batch = runner.run(engine, problems, params, reward_fn, special_tokens, sync_hook)
    seconds = time.perf_counter() - started
    experience = Experience.from_generations(
        batch.prompt_ids,
        [[generation] for generation in batch.generations],
        batch.scores,
        pad_token_id=runner.tokenizer.pad_token_id,
        policy_version=engine.policy_version,
        temperature=params.temperature,
        response_width=runner.config.max_response_tokens,
    )
    experience = dataclasses.replace(
        experience, group_ids=torch.tensor([first_group + g for g in batch.groups], dtype=torch.long)
    )
    firsts: dict[int, int] = {}  # each group's first sample (groups come in row order)
    for i, group in enumerate(batch.groups):
        firsts.setdefault(group, i)
    texts = [
        f"{problems[g]['prompt']!r} → {batch.completions[i]!r} (answer {problems[g]['answer']!r}, "
        f"score {batch.scores[i]})"
        for g, i in firsts.items()
    ]
    finished = [g.finish_reason == "stop" for g in batch.generations]
    # the reward function's seconds are inside the episodes' (it scores after they end)
    return Round(experience, batch.rewards, finished, texts, seconds, 0.0, None, params.n, batch.counts)


def assemble(
    rounds: list[Round],
    target: int,
    pad_token_id: int,
    *,
    filter_groups: bool,
    policy_version: int,
    mixed_versions: bool,
    resampling: bool,
) -> RolloutResult:
    """One step's experience and metrics from its rounds: every sample counts in ``reward/*`` and
    ``rollout/*``; with ``filter_groups`` only the first ``target`` informative groups are kept (all
    of the first round's samples where no group is informative). ``mixed_versions`` (partial
    rollouts) adds ``rollout/mixed_version_fraction``, ``resampling`` (``max_sampling_rounds`` > 1)
    ``rollout/sampling_rounds`` and ``rollout/sampled_prompts``."""
    n = rounds[0].samples_per_group
    everything = Experience.cat([r.experience for r in rounds], pad_token_id)
    experience = everything
    if filter_groups:
        keep = torch.cat([r.informative for r in rounds]).nonzero().squeeze(1)
        # no informative group at all: keep the first round whole. Under a group baseline its advantages
        # are 0 anyway, and every data-parallel rank still runs its update (and its collectives).
        experience = everything.select(keep[: target * n]) if len(keep) else rounds[0].experience
    lengths = masked_count(everything.response_mask, dim=-1)
    finished = [done for r in rounds for done in r.finished]
    scores = everything.scores
    generate_seconds = sum(r.generate_seconds for r in rounds)
    count = len(everything)
    metrics = {
        "rollout/response_length_mean": lengths.float().mean().item(),
        "rollout/response_length_max": lengths.max().item(),
        "rollout/stop_fraction": sum(finished) / count,
        "rollout/tokens_per_second": lengths.sum().item() / max(generate_seconds, 1e-9),
        "rollout/policy_version": float(policy_version),
        "reward/mean": scores.mean().item(),
        "reward/std": scores.std(correction=0).item(),  # 0: every sample scored alike
        "reward/accuracy": (scores >= 1.0).float().mean().item(),
        "reward/malformed_fraction": sum(r.rewards.num_malformed for r in rounds) / count,
        "reward/error_fraction": sum(r.rewards.num_errors for r in rounds) / count,
        "reward/timeout_fraction": sum(r.rewards.num_timeouts for r in rounds) / count,
        "reward/worker_restarts": float(sum(r.rewards.worker_restarts for r in rounds)),
        "reward/unscored_fraction": unscored_fraction([r.rewards for r in rounds]),
        "timing/generate": generate_seconds,
        "timing/reward": sum(r.reward_seconds for r in rounds),
        **function_metrics([r.rewards for r in rounds]),
        **count_metrics([r.rewards for r in rounds]),
    }
    if everything.truncated is not None:  # stopped at max_tokens (finish reason "length")
        metrics["rollout/truncated_fraction"] = everything.truncated.float().mean().item()
    if rounds[0].episodes is not None:
        metrics.update(functools.reduce(operator.add, (r.episodes for r in rounds)).metrics())
    if filter_groups:
        metrics["rollout/filtered_groups_fraction"] = 1.0 - len(experience) / count
    if mixed_versions:
        metrics["rollout/mixed_version_fraction"] = mixed_version_fraction(everything)
    if resampling:
        metrics["rollout/sampling_rounds"] = float(len(rounds))
        metrics["rollout/sampled_prompts"] = float(count // n)
    return RolloutResult(experience, metrics, rounds[0].texts)


def mixed_version_fraction(experience: Experience) -> float:
    """The share of samples whose response tokens were sampled by more than one policy version."""
    valid = experience.response_mask.bool()
    versions = experience.token_versions
    newest = versions.masked_fill(~valid, torch.iinfo(versions.dtype).min).amax(dim=1)
    oldest = versions.masked_fill(~valid, torch.iinfo(versions.dtype).max).amin(dim=1)
    return ((newest > oldest) & valid.any(dim=1)).float().mean().item()
