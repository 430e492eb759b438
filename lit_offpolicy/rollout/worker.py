"""RolloutWorker: one engine and one reward function that sample, score, pack, sync and evaluate.

Both rollout callbacks compose one: ``Rollout`` calls it from the training loop, ``AsyncRollout``
from its producer thread. The worker knows nothing of scheduling (when to sample, sync or evaluate).
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Iterator

import lightning as L
import torch

from lit_offpolicy.core.checks import check_range
from lit_offpolicy.core.distributed import min_over_ranks, params_sharded
from lit_offpolicy.core.flops import sequence_lengths, stage_metrics
from lit_offpolicy.core.records import RolloutHost, RolloutResult
from lit_offpolicy.data import prompt_special_tokens
from lit_offpolicy.data.prompts import uses_chat_template
from lit_offpolicy.environments import EpisodeConfig
from lit_offpolicy.rewards import RewardConfig, failure_summary, unscored_fraction
from lit_offpolicy.rollout.agents import AgentConfig, AgentRunner
from lit_offpolicy.rollout.engine import (
    EngineContext,
    EngineSpec,
    RolloutEngine,
    SamplingParams,
    WeightSyncHook,
)
from lit_offpolicy.rollout.episodes import EpisodeRunner
from lit_offpolicy.rollout.evaluation import ValidationConfig, evaluate, publish, validation_sources
from lit_offpolicy.rollout.filtering import PromptHistory, first_groups, group_count, next_round_size
from lit_offpolicy.rollout.rounds import (
    Round,
    assemble,
    first_group_id,
    round_params,
    round_problems,
    sample_agent_round,
    sample_round,
)
from lit_offpolicy.rollout.weight_sync import DEFAULT_BUCKET_MB, stream_full_weights


class RolloutWorker:
    """One engine and one reward function: samples, scores and packs; pushes weights; evaluates.

    It samples ``sampling.n`` responses per prompt, scores them and packs them into an
    ``Experience``, in rounds (``rollout.rounds``).

    Sampling is seeded per step, rank and round: seed + step + rank × ``RANK_SEED_STRIDE`` + round ×
    ``ROUND_SEED_STRIDE`` (``rounds.round_params``), seed being :attr:`run_seed`.

    Args:
        spec: the engine, built at ``start``.
        sampling: how to sample (``SamplingParams``).
        reward: the reward function and its isolation (``RewardConfig``).
        validation: when and how to evaluate (``ValidationConfig``).
        own_copy: the engine must not sample from the parameters being optimized (``EngineContext``).
        filter_groups: drop the groups whose rewards are all equal (DAPO; ``rollout.filtering``).
        max_sampling_rounds: with ``filter_groups``, re-sample up to this many rounds in all to make the
            step's informative groups up to its number of prompts (DAPO's dynamic sampling).
        pre_rollout_filter: with ``filter_groups``, GRESO's pre-rollout filter (``filtering.PromptHistory``).
        episodes: each sample a multi-turn episode with an environment (``rollout.episodes``), scored
            by the reward function on its last turn plus the environment's rewards; None: one generation.
        agent: each sample an episode of the user's agent against the run's OpenAI-compatible endpoint
            (``rollout.agents``); None: off.
        sync_bucket_mb: MiB per bucket of the streamed weight sync (``weight_sync``).
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
        agent: AgentConfig | None = None,
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
        if agent is not None and episodes is not None:
            raise ValueError(
                "agent and episodes are two ways to run episodes: set one of them, the other null"
            )
        if agent is not None and filter_groups:
            raise ValueError(
                "filter_groups=True is not supported with agent (an episode's branches make groups of "
                "varying size): set filter_groups=False"
            )
        self.max_sampling_rounds = max_sampling_rounds
        self.sync_bucket_bytes = check_range("sync_bucket_mb", sync_bucket_mb, low=1) * 2**20
        self.history = None if pre_rollout_filter is None else PromptHistory(pre_rollout_filter)
        self.spec = spec
        self.sampling = sampling
        self.validation = validation
        self.filter_groups = filter_groups
        self.reward_fn = reward.build()
        self.reward_timeout = reward.timeout
        self.max_failed_steps = reward.max_failed_steps
        self.failed_steps = 0
        """Steps in a row in which no sample got a reward (``failed_rewards``)."""
        self.failure: str | None = None
        """What left the last rolled-out step's samples unscored (``rewards.failure_summary``), if it was."""
        self.own_copy = own_copy
        self.episodes = episodes
        self.environment = episodes.build() if episodes is not None else None
        if agent is not None:
            agent.build()  # a wrong import path or signature: one line at start-up, before any model loads
        self.agent = agent
        self.runner: EpisodeRunner | AgentRunner | None = None  # built with the tokenizer (start)
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
        prompt_tokens = getattr(trainer.datamodule, "max_prompt_length", None)
        if self.agent is not None:
            prompt_tokens = self.agent.max_prompt_tokens
            self.runner = AgentRunner(self.agent, host.tokenizer)
            if not getattr(host.tokenizer, "chat_template", None) and trainer.global_rank == 0:
                print(
                    f"lit-offpolicy: {host.model_path} has no chat template: the agents' endpoint answers "
                    "/v1/chat/completions with HTTP 400; agents can use /v1/completions (docs/agents.md)",
                    flush=True,
                )
        self.size_engine(prompt_tokens, host.model_path)
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
                log_file=engine_log_file(trainer),
                bucket_bytes=self.sync_bucket_bytes,
                world_size=trainer.world_size,
                rank=trainer.global_rank,
            )
        )
        log_file = getattr(self.engine, "log_file", None)
        if log_file is not None and trainer.global_rank == 0:
            level = getattr(self.engine, "log_level", "WARNING")
            print(f"lit-offpolicy: vLLM's log ({level} and above) goes to {log_file}", flush=True)
        note = getattr(self.engine, "start_note", None)  # e.g. the rollout servers and their logs
        if note and trainer.global_rank == 0:
            print(f"lit-offpolicy: {note}", flush=True)

    @property
    def longest_response(self) -> tuple[str, int]:
        """The option that bounds a response's tokens, and its value (an episode's whole budget)."""
        if self.episodes is not None:
            return "episodes.max_response_tokens", self.episodes.max_response_tokens
        if self.agent is not None:
            return "agent.max_response_tokens", self.agent.max_response_tokens
        return "sampling.max_tokens", self.sampling.max_tokens

    def size_engine(self, prompt_tokens: int | None, model_path: str) -> None:
        """Fit the engine's length limit to the prompts and the longest response (``EngineSpec.sized``):
        a ValueError naming the options when they cannot fit, before the engine loads."""
        option, tokens = self.longest_response
        self.spec = self.spec.sized(prompt_tokens, tokens, str(model_path), response_option=option)

    def close(self) -> None:
        """Release the reward's workers and the engine (safe to call more than once)."""
        close_reward = getattr(self.reward_fn, "close", None)
        if callable(close_reward):
            close_reward()
        if self.environment is not None:
            self.environment.close()
        if isinstance(self.runner, AgentRunner):
            self.runner.close()
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
        """Sample, score and pack one batch of problems (``data.batch_problems``).

        ``step`` numbers it for the seed and the group ids.

        With ``filter_groups`` and ``max_sampling_rounds`` > 1, while the step holds fewer informative
        groups than ``len(batch)``, another round samples training problems drawn at random
        (``filtering.next_round_size`` of them, seeded by run seed, step, rank and round); the step then
        trains on the first ``len(batch)`` informative groups, or on all of them after the last round.
        """
        target, rank = len(batch), trainer.global_rank
        first_group = first_group_id(step, rank, trainer.world_size, target, self.max_sampling_rounds)
        skipped_before = self.history.skipped if self.history is not None else 0
        rounds: list[Round] = []
        informative = sampled = 0
        while not rounds or (
            self.filter_groups and informative < target and len(rounds) < self.max_sampling_rounds
        ):
            count = next_round_size(target, informative, sampled) if rounds else target
            index, seed = len(rounds), self.run_seed
            problems = round_problems(
                batch,
                count,
                index,
                train_problems=getattr(trainer.datamodule, "train_problems", None) or [],
                history=self.history,
                key=f"{seed}/{step}/{rank}/{index}",
            )
            params = round_params(self.sampling, seed, step, rank, index)
            special_tokens = prompt_special_tokens(trainer.datamodule)
            if isinstance(self.runner, AgentRunner):
                more = sample_agent_round(
                    self.engine, self.reward_fn, self.runner, problems, params, special_tokens=special_tokens,
                    first_group=first_group + sampled, sync_hook=self.sync_hook,
                )  # fmt: skip
            else:
                more = sample_round(
                    self.engine, self.reward_fn, host.tokenizer, problems, params,
                    special_tokens=special_tokens, first_group=first_group + sampled,
                    filter_groups=self.filter_groups, runner=self.runner, sync_hook=self.sync_hook,
                )  # fmt: skip
            if self.history is not None:
                self.history.record(
                    [p["prompt"] for p in problems], more.informative[:: more.samples_per_group].tolist()
                )
            rounds.append(more)
            informative += more.informative_groups if self.filter_groups else 0
            sampled += len(problems)
        result = assemble(
            rounds,
            target,
            host.tokenizer.pad_token_id,
            filter_groups=self.filter_groups,
            policy_version=self.engine.policy_version,
            mixed_versions=self.sync_hook is not None,
            resampling=self.max_sampling_rounds > 1,
        )
        if not getattr(self.engine, "remote", False):  # it samples on this process's device
            result.metrics.update(generation_perf(rounds, host.actor, result.metrics["timing/generate"]))
        if self.history is not None:
            result.metrics["rollout/skipped_prompts"] = float(self.history.skipped - skipped_before)
        outputs = [r.rewards for r in rounds]
        self.failure = None
        if unscored_fraction(outputs) >= 1:
            first = next((output.first_error for output in outputs if output.first_error), "")
            agent_failed = self.agent is not None and first.startswith("agent ")
            self.failure = (
                f"every episode failed; the first: {first}"
                if agent_failed
                else failure_summary(outputs, self.reward_timeout)
            )
        return result

    def engine_metrics(self) -> dict[str, float]:
        """The engine's own metrics now (the server pool's ``rollout/servers_alive``), if it has any:
        logged with each step, after the ranks agreed on the servers lost."""
        metrics = getattr(self.engine, "metrics", None)
        return metrics() if callable(metrics) else {}

    def failed_rewards(self, metrics: dict[str, float]) -> str | None:
        """Count a step whose ``reward/unscored_fraction`` (reduced over ranks) is 1; after
        ``reward.max_failed_steps`` such steps in a row, the one-line reason to stop the run."""
        self.failed_steps = (
            self.failed_steps + 1 if metrics.get("reward/unscored_fraction", 0.0) >= 1.0 else 0
        )
        if self.failed_steps < self.max_failed_steps:
            return None
        reason = self.failure or "no sample got a value from any reward function"
        steps, limit = self.failed_steps, self.max_failed_steps
        return f"{reason}, for {steps} steps in a row (reward.max_failed_steps={limit})"

    def equal_groups(self, result: RolloutResult, device: torch.device | str) -> RolloutResult:
        """With ``filter_groups``: every data-parallel rank keeps as many groups as the rank with the fewest.

        One ``all_reduce`` MIN; a rank keeps its first groups, so that all ranks take the same number
        of micro-batches and optimizer steps. Logs ``rollout/train_groups`` (groups trained per rank)
        and ``rollout/rank_balance_cut_groups`` (groups this rank dropped for it; mean over ranks).

        A collective: call it from the training loop's thread, at the same point on every rank.
        """
        if not self.filter_groups:
            return result
        experience = result.experience
        groups = group_count(experience.group_ids)
        # The minimum after the rounds, rather than sampling on while any rank is short: a rank ends short
        # only after its max_sampling_rounds, so more rounds on the others cannot help it; and under
        # AsyncRollout a collective per round would run in each rank's producer thread, beside the
        # trainer's collectives and in an order that each rank's staleness drops change: a deadlock.
        # The cost: when a rank ends short, the others drop informative groups they sampled.
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


def engine_log_file(trainer: L.Trainer) -> str | None:
    """``vllm.log`` (``vllm_rank{r}.log`` on rank r > 0) in the run's log directory; None for a run
    whose logger writes no files (or without a logger): the engine logs to the console then."""
    logger = trainer.logger
    if logger is None or not (getattr(logger, "log_dir", None) or getattr(logger, "save_dir", None)):
        return None
    directory = trainer.log_dir
    name = "vllm.log" if trainer.global_rank == 0 else f"vllm_rank{trainer.global_rank}.log"
    return os.path.join(directory, name)


def generation_perf(rounds: list[Round], actor: torch.nn.Module, seconds: float) -> dict[str, float]:
    """``perf/*/generate`` of every sample the rounds drew (kept or filtered out), one forward of the
    actor's shape each (``core.flops``)."""
    lengths = sequence_lengths(*(r.experience for r in rounds))
    return stage_metrics("generate", [(actor, 1)], lengths, seconds)
