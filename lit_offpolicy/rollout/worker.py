"""RolloutWorker: one engine and one reward function that sample, score, pack, sync and evaluate.

Both rollout callbacks compose one: ``Rollout`` calls it from the training loop, ``AsyncRollout``
from its producer thread. The worker knows nothing of scheduling (when to sample, sync or evaluate).
"""

from __future__ import annotations

import dataclasses
import os
import random
import time
from collections.abc import Iterator

import lightning as L
import torch

from lit_offpolicy.core.checks import check_range
from lit_offpolicy.core.distributed import RANK_SEED_STRIDE, min_over_ranks, params_sharded
from lit_offpolicy.core.experience import Experience
from lit_offpolicy.core.masked import masked_count
from lit_offpolicy.core.records import RolloutHost, RolloutResult
from lit_offpolicy.data import prompt_special_tokens
from lit_offpolicy.data.prompts import uses_chat_template
from lit_offpolicy.environments import EpisodeConfig
from lit_offpolicy.rewards import RewardConfig, RewardInputs, RewardOutput, function_means
from lit_offpolicy.rollout.engine import (
    EngineContext,
    EngineSpec,
    RolloutEngine,
    SamplingParams,
    WeightSyncHook,
)
from lit_offpolicy.rollout.episodes import EpisodeCounts, EpisodeRunner
from lit_offpolicy.rollout.evaluation import ValidationConfig, evaluate, publish, validation_sources
from lit_offpolicy.rollout.filtering import (
    ROUND_GROWTH_LIMIT,
    PromptHistory,
    draw_problems,
    first_groups,
    group_count,
    informative_samples,
    next_round_size,
)
from lit_offpolicy.rollout.weight_sync import DEFAULT_BUCKET_MB, stream_full_weights

ROUND_SEED_STRIDE = 100_003
"""Sampling seeds of a step's re-sampling rounds are this far apart (ranks: ``RANK_SEED_STRIDE``)."""


@dataclasses.dataclass
class _Round:
    """One sampling round of a step, scored and packed, before any filtering."""

    experience: Experience
    rewards: RewardOutput
    finished: list[bool]
    texts: list[str]
    generate_seconds: float
    reward_seconds: float
    informative: torch.Tensor | None  # per sample, where groups are filtered
    samples_per_group: int
    episodes: EpisodeCounts | None  # multi-turn episodes: what the env/* metrics count

    @property
    def informative_groups(self) -> int:
        return int(self.informative.sum()) // self.samples_per_group


def mixed_version_fraction(experience: Experience) -> float:
    """The share of samples whose response tokens were sampled by more than one policy version."""
    valid = experience.response_mask.bool()
    versions = experience.token_versions
    newest = versions.masked_fill(~valid, torch.iinfo(versions.dtype).min).amax(dim=1)
    oldest = versions.masked_fill(~valid, torch.iinfo(versions.dtype).max).amin(dim=1)
    return ((newest > oldest) & valid.any(dim=1)).float().mean().item()


class RolloutWorker:
    """Samples ``sampling.n`` responses per prompt with an engine built from ``spec``, scores them
    with ``reward`` and packs them into an :class:`Experience`; pushes weights; evaluates.

    ``own_copy``: the engine must not sample from the parameters being optimised (see
    :class:`EngineContext`). ``filter_groups``: drop the groups whose rewards are all equal from the
    experience (``rollout.filtering``); where every group is, the step keeps them all (under a group
    baseline their advantages are 0 anyway, and every data-parallel rank still runs its update).
    ``max_sampling_rounds``: with ``filter_groups``, re-sample up to this many rounds in all to make
    the step's informative groups up to its number of prompts (DAPO's dynamic sampling).
    ``pre_rollout_filter``: with ``filter_groups``, skip prompts whose recent groups were all
    uninformative before sampling them, with GRESO's probability (``filtering.PromptHistory``), and
    sample training problems that pass in their place. ``episodes``: each sample is a multi-turn
    episode with an environment (``rollout.episodes.EpisodeRunner``), scored by the reward function on
    its last turn plus the environment's rewards; None: one generation per sample.

    Sampling is seeded per step, rank and round: seed + step + rank × 1_000_003 + round × 100_003,
    where seed is ``sampling.seed`` or, where that is None, the run's ``seed_everything``
    (:attr:`run_seed`); unseeded only when the run has neither.
    """

    def __init__(
        self,
        spec: EngineSpec,
        sampling: SamplingParams,
        reward: RewardConfig,
        validation: ValidationConfig,
        own_copy: bool,
        filter_groups: bool = False,
        max_sampling_rounds: int = 1,
        pre_rollout_filter: float | None = None,
        episodes: EpisodeConfig | None = None,
        sync_bucket_mb: int = DEFAULT_BUCKET_MB,
    ) -> None:
        if filter_groups and sampling.n < 2:
            raise ValueError(
                f"filter_groups=True needs groups: sampling.n={sampling.n}; allowed values: n >= 2"
            )
        check_range("max_sampling_rounds", max_sampling_rounds, low=1)
        if max_sampling_rounds > 1 and not filter_groups:
            raise ValueError(
                f"max_sampling_rounds={max_sampling_rounds} re-samples for the groups filter_groups drops: "
                "set filter_groups=True, or max_sampling_rounds=1"
            )
        if pre_rollout_filter is not None and not filter_groups:
            raise ValueError(
                f"pre_rollout_filter={pre_rollout_filter} skips prompts by the groups filter_groups finds "
                "uninformative: set filter_groups=True, or pre_rollout_filter=null"
            )
        self.max_sampling_rounds = max_sampling_rounds
        self.sync_bucket_bytes = check_range("sync_bucket_mb", sync_bucket_mb, low=1) * 2**20
        self.history = None if pre_rollout_filter is None else PromptHistory(pre_rollout_filter)
        self.spec = spec
        self.sampling = sampling
        self.validation = validation
        self.filter_groups = filter_groups
        self.reward_fn = reward.build()
        self.own_copy = own_copy
        self.episodes = episodes
        self.environment = episodes.build() if episodes is not None else None
        self.runner: EpisodeRunner | None = None  # built with the tokenizer (start)
        self.engine: RolloutEngine | None = None
        self.sync_hook: WeightSyncHook | None = None
        """Partial rollouts (``AsyncRollout``): handed to the engine's ``generate`` as ``sync``."""

    @property
    def run_seed(self) -> int | None:
        """``sampling.seed``, or where it is None the run's ``seed_everything`` (``PL_GLOBAL_SEED``)."""
        if self.sampling.seed is None and "PL_GLOBAL_SEED" in os.environ:
            return int(os.environ["PL_GLOBAL_SEED"])
        return self.sampling.seed

    def start(self, trainer: L.Trainer, host: RolloutHost) -> None:
        """Build the engine, serving the actor's current weights (``on_fit_start``)."""
        drawing = [f"max_sampling_rounds={self.max_sampling_rounds}"] if self.max_sampling_rounds > 1 else []
        if self.history is not None:
            drawing.append(f"pre_rollout_filter={self.history.explore}")
        if drawing and not getattr(trainer.datamodule, "train_problems", None):
            raise ValueError(
                f"{' and '.join(drawing)} draw prompts from the data module's train_problems "
                "(lit_offpolicy.data.PromptDataModule), which this run's data module lacks"
            )
        if self.episodes is not None:
            chat = uses_chat_template(
                host.tokenizer, getattr(trainer.datamodule, "apply_chat_template", True)
            )
            self.runner = EpisodeRunner(self.environment, self.episodes, host.tokenizer, chat)
        self.engine = self.spec.build(
            EngineContext(
                model_path=host.model_path,
                dtype=host.model_dtype,
                tokenizer=host.tokenizer,
                actor=host.actor,
                device=host.device,
                policy_version=host.policy_version,
                weights=lambda: self.weights(trainer, host),
                sharded=params_sharded(trainer.strategy),
                own_copy=self.own_copy,
            )
        )

    def close(self) -> None:
        """Release the reward's workers and the engine (safe to call more than once)."""
        close_reward = getattr(self.reward_fn, "close", None)
        if callable(close_reward):
            close_reward()
        if self.environment is not None:
            self.environment.close()
        if self.engine is not None:
            self.engine.close()
            self.engine = None

    def weights(self, trainer: L.Trainer, host: RolloutHost) -> Iterator[tuple[str, torch.Tensor]]:
        """The actor's full weights for a sync, streamed in buckets of ``sync_bucket_mb``
        (``weight_sync.stream_full_weights``; under FSDP2/ZeRO-3 every rank must consume them)."""
        return stream_full_weights(trainer.strategy, host, bucket_bytes=self.sync_bucket_bytes)

    def sync(self, weights: dict[str, torch.Tensor], version: int) -> float:
        """Load ``weights`` into the engine as ``version``; the seconds it took."""
        started = time.perf_counter()
        self.engine.load_weights(weights, version)
        return time.perf_counter() - started

    def rollout(self, trainer: L.Trainer, host: RolloutHost, batch: list[dict], step: int) -> RolloutResult:
        """Sample, score and pack one batch of problems (``data.batch_problems``). ``step`` numbers it
        for the seed and the group ids.

        With ``filter_groups`` and ``max_sampling_rounds`` > 1, while the step holds fewer informative
        groups than ``len(batch)``, another round samples training problems drawn at random
        (``filtering.next_round_size`` of them, seeded by run seed, step, rank and round); the step then
        trains on the first ``len(batch)`` informative groups, or on all of them after the last round.
        """
        target = len(batch)
        # group ids unique over steps and ranks: (step, rank) numbers blocks of `stride` ids
        stride = target * (1 + ROUND_GROWTH_LIMIT * (self.max_sampling_rounds - 1))
        first_group = (step * trainer.world_size + trainer.global_rank) * stride
        skipped_before = self.history.skipped if self.history is not None else 0
        rounds: list[_Round] = []
        informative = sampled = 0
        while not rounds or (
            self.filter_groups and informative < target and len(rounds) < self.max_sampling_rounds
        ):
            count = next_round_size(target, informative, sampled) if rounds else target
            problems = self._round_problems(trainer, batch, count, step, len(rounds))
            more = self._sample_round(trainer, host, problems, step, len(rounds), first_group + sampled)
            if self.history is not None:
                self.history.record(
                    [p["prompt"] for p in problems], more.informative[:: more.samples_per_group].tolist()
                )
            rounds.append(more)
            informative += more.informative_groups if self.filter_groups else 0
            sampled += len(problems)
        result = self._assemble(rounds, target, host.tokenizer.pad_token_id)
        if self.history is not None:
            result.metrics["rollout/skipped_prompts"] = float(self.history.skipped - skipped_before)
        return result

    def _round_problems(
        self, trainer: L.Trainer, batch: list[dict], count: int, step: int, round_index: int
    ) -> list[dict]:
        """The problems one round samples: the step's batch in round 0, ``count`` training problems
        drawn at random in the others. Under ``pre_rollout_filter``, the batch's problems that pass the
        filter, and drawn problems that pass it up to ``count``."""
        train_problems = getattr(trainer.datamodule, "train_problems", None) or []
        seed = f"{self.run_seed}/{step}/{trainer.global_rank}/{round_index}"
        if self.history is None:
            return batch if round_index == 0 else draw_problems(train_problems, count, f"resample/{seed}")
        rng = random.Random(f"pre-rollout/{seed}")
        kept = self.history.select(batch, rng) if round_index == 0 else []
        return kept + self.history.draw(train_problems, count - len(kept), rng)

    def _sample_round(
        self,
        trainer: L.Trainer,
        host: RolloutHost,
        problems: list[dict],
        step: int,
        round_index: int,
        first_group: int,
    ) -> _Round:
        """Sample ``sampling.n`` responses to each problem's prompt, score them and pack them (unfiltered)."""
        tokenizer = host.tokenizer
        prompts = [problem["prompt"] for problem in problems]
        special_tokens = prompt_special_tokens(trainer.datamodule)
        params = self.sampling
        seed = self.run_seed
        if seed is not None:
            seed += step + trainer.global_rank * RANK_SEED_STRIDE + round_index * ROUND_SEED_STRIDE
            params = dataclasses.replace(params, seed=seed)
        started = time.perf_counter()
        episodes = None
        if self.runner is None:
            prompt_ids = tokenizer(list(prompts), add_special_tokens=special_tokens).input_ids
            if self.sync_hook is None:
                generations = self.engine.generate(prompt_ids, params)
            else:
                generations = self.engine.generate(prompt_ids, params, sync=self.sync_hook)
            completion_ids = [g.token_ids for group in generations for g in group]
            responses = [tokenizer.decode(ids, skip_special_tokens=True) for ids in completion_ids]
            width, extra = params.max_tokens, [0.0] * len(responses)
        else:
            batch = self.runner.run(self.engine, problems, params, special_tokens, self.sync_hook)
            prompt_ids, generations, episodes = batch.prompt_ids, batch.generations, batch.counts
            responses, completion_ids = batch.completions, batch.completion_ids
            width, extra = self.episodes.max_response_tokens, batch.rewards
        generate_seconds = time.perf_counter() - started
        inputs = RewardInputs.of(problems, responses, completion_ids, params.n)
        started = time.perf_counter()
        rewards: RewardOutput = self.reward_fn(inputs)
        reward_seconds = time.perf_counter() - started
        scores = [score + bonus for score, bonus in zip(rewards.scores, extra, strict=True)]
        experience = Experience.from_generations(
            prompt_ids,
            generations,
            scores,
            pad_token_id=tokenizer.pad_token_id,
            policy_version=self.engine.policy_version,
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
        informative = (
            informative_samples(experience.scores, experience.group_ids) if self.filter_groups else None
        )
        return _Round(
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

    def _assemble(self, rounds: list[_Round], target: int, pad_token_id: int) -> RolloutResult:
        """One step's experience and metrics from its rounds: every sample counts in ``reward/*`` and
        ``rollout/*``; with ``filter_groups`` only the first ``target`` informative groups are kept
        (all of the first round's samples where no group is informative)."""
        everything = Experience.cat([r.experience for r in rounds], pad_token_id)
        experience = everything
        if self.filter_groups:
            keep = torch.cat([r.informative for r in rounds]).nonzero().squeeze(1)
            if len(keep):
                experience = everything.select(keep[: target * self.sampling.n])
            else:
                experience = rounds[0].experience
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
            "rollout/policy_version": float(self.engine.policy_version),
            "reward/mean": scores.mean().item(),
            "reward/accuracy": (scores >= 1.0).float().mean().item(),
            "reward/malformed_fraction": sum(r.rewards.num_malformed for r in rounds) / count,
            "reward/error_fraction": sum(r.rewards.num_errors for r in rounds) / count,
            "reward/timeout_fraction": sum(r.rewards.num_timeouts for r in rounds) / count,
            "timing/generate": generate_seconds,
            "timing/reward": sum(r.reward_seconds for r in rounds),
            **function_means([r.rewards for r in rounds]),
        }
        if self.runner is not None:
            metrics.update(sum((r.episodes for r in rounds), EpisodeCounts()).metrics())
        if self.filter_groups:
            metrics["rollout/filtered_groups_fraction"] = 1.0 - len(experience) / count
        if self.sync_hook is not None:
            metrics["rollout/mixed_version_fraction"] = mixed_version_fraction(everything)
        if self.max_sampling_rounds > 1:
            metrics["rollout/sampling_rounds"] = float(len(rounds))
            metrics["rollout/sampled_prompts"] = float(count // self.sampling.n)
        return RolloutResult(experience, metrics, rounds[0].texts)

    def equal_groups(self, result: RolloutResult, device: torch.device | str) -> RolloutResult:
        """With ``filter_groups``: every data-parallel rank keeps the number of groups the rank with the
        fewest holds (one ``all_reduce`` MIN; its first groups), so that all ranks take the same number
        of micro-batches and optimizer steps. Logs ``rollout/train_groups`` (groups trained per rank)
        and ``rollout/rank_balance_cut_groups`` (groups this rank dropped for it; mean over ranks).

        A collective: call it from the training loop's thread, at the same point on every rank.

        Why the minimum after the rounds, not sampling on while any rank is short: a rank ends short
        only after its ``max_sampling_rounds``, so more rounds on the others cannot help it; and under
        ``AsyncRollout`` a collective per round would run in each rank's producer thread, beside the
        trainer's collectives and in an order that each rank's staleness drops change, which can
        deadlock. The cost: when a rank ends short, the others drop informative groups they sampled.
        """
        if not self.filter_groups:
            return result
        experience = result.experience
        groups = group_count(experience.group_ids)
        fewest = min_over_ranks(groups, device)
        if fewest < groups:
            experience = experience.select(first_groups(experience.group_ids, fewest))
        metrics = {
            **result.metrics,
            "rollout/train_groups": float(fewest),
            "rollout/rank_balance_cut_groups": float(groups - fewest),
        }
        return dataclasses.replace(result, experience=experience, metrics=metrics)

    def evaluate(self, trainer: L.Trainer, host: RolloutHost) -> dict[str, float]:
        """``val/accuracy``, ``val/reward`` (and ``val/pass@k``) on the validation prompts, logged with
        ``timing/evaluate`` (seconds)."""
        datamodule = trainer.datamodule
        pass_k_params = None
        if self.validation.pass_k > 1:
            pass_k_params = dataclasses.replace(self.sampling, n=self.validation.pass_k, seed=self.run_seed)
        started = time.perf_counter()
        metrics = evaluate(
            self.engine,
            host.tokenizer,
            datamodule.val_dataloader() if datamodule is not None else [],
            self.reward_fn,
            max_tokens=self.sampling.max_tokens,
            add_special_tokens=prompt_special_tokens(datamodule),
            pass_k_params=pass_k_params,
            device=host.device,
            sources=validation_sources(getattr(datamodule, "val_problems", None)),
            episodes=self.runner,
        )
        if metrics:
            publish(trainer, {**metrics, "timing/evaluate": time.perf_counter() - started})
        return metrics
