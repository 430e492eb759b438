"""RolloutWorker: one engine and one reward function that sample, score, pack, sync and evaluate.

Both rollout callbacks compose one: ``Rollout`` calls it from the training loop, ``AsyncRollout``
from its producer thread. The worker knows nothing of scheduling (when to sample, sync or evaluate).
"""

from __future__ import annotations

import dataclasses
import os
import time

import lightning as L
import torch

from lit_offpolicy.data import prompt_special_tokens
from lit_offpolicy.distributed import RANK_SEED_STRIDE, full_state_dict, params_sharded
from lit_offpolicy.evaluation import ValidationConfig, evaluate, publish
from lit_offpolicy.experience import Experience
from lit_offpolicy.masked import masked_count
from lit_offpolicy.records import RolloutHost, RolloutResult
from lit_offpolicy.rewards import RewardConfig, RewardOutput
from lit_offpolicy.rollout.engine import EngineContext, EngineSpec, RolloutEngine, SamplingParams
from lit_offpolicy.rollout.filtering import informative_samples


class RolloutWorker:
    """Samples ``sampling.n`` responses per prompt with an engine built from ``spec``, scores them
    with ``reward`` and packs them into an :class:`Experience`; pushes weights; evaluates.

    ``own_copy``: the engine must not sample from the parameters being optimised (see
    :class:`EngineContext`). ``filter_groups``: drop the groups whose rewards are all equal from the
    experience (``rollout.filtering``); where every group is, the step keeps them all (under a group
    baseline their advantages are 0 anyway, and every data-parallel rank still runs its update).

    Sampling is seeded per step and rank: seed + step + rank × 1_000_003,
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
    ) -> None:
        if filter_groups and sampling.n < 2:
            raise ValueError(
                f"filter_groups=True needs groups: sampling.n={sampling.n}; allowed values: n >= 2"
            )
        self.spec = spec
        self.sampling = sampling
        self.validation = validation
        self.filter_groups = filter_groups
        self.reward_fn = reward.build()
        self.own_copy = own_copy
        self.engine: RolloutEngine | None = None

    @property
    def run_seed(self) -> int | None:
        """``sampling.seed``, or where it is None the run's ``seed_everything`` (``PL_GLOBAL_SEED``)."""
        if self.sampling.seed is None and "PL_GLOBAL_SEED" in os.environ:
            return int(os.environ["PL_GLOBAL_SEED"])
        return self.sampling.seed

    def start(self, trainer: L.Trainer, host: RolloutHost) -> None:
        """Build the engine, serving the actor's current weights (``on_fit_start``)."""
        self.engine = self.spec.build(
            EngineContext(
                model_path=host.model_path,
                dtype=host.model_dtype,
                tokenizer=host.tokenizer,
                actor=host.actor,
                device=host.device,
                policy_version=host.policy_version,
                weights=lambda: full_state_dict(trainer.strategy, host),
                sharded=params_sharded(trainer.strategy),
                own_copy=self.own_copy,
            )
        )

    def close(self) -> None:
        """Release the reward's workers and the engine (safe to call more than once)."""
        close_reward = getattr(self.reward_fn, "close", None)
        if callable(close_reward):
            close_reward()
        if self.engine is not None:
            self.engine.close()
            self.engine = None

    def sync(self, weights: dict[str, torch.Tensor], version: int) -> float:
        """Load ``weights`` into the engine as ``version``; the seconds it took."""
        started = time.perf_counter()
        self.engine.load_weights(weights, version)
        return time.perf_counter() - started

    def rollout(
        self, trainer: L.Trainer, host: RolloutHost, prompts: list[str], answers: list[str], step: int
    ) -> RolloutResult:
        """Sample, score and pack one batch. ``step`` numbers it for the seed and the group ids."""
        tokenizer = host.tokenizer
        prompt_ids = tokenizer(
            list(prompts), add_special_tokens=prompt_special_tokens(trainer.datamodule)
        ).input_ids
        params = self.sampling
        seed = self.run_seed
        if seed is not None:
            params = dataclasses.replace(params, seed=seed + step + trainer.global_rank * RANK_SEED_STRIDE)
        started = time.perf_counter()
        generations = self.engine.generate(prompt_ids, params)
        generate_seconds = time.perf_counter() - started
        responses = [
            tokenizer.decode(g.token_ids, skip_special_tokens=True) for group in generations for g in group
        ]
        repeated_answers = [answer for answer in answers for _ in range(params.n)]
        started = time.perf_counter()
        rewards: RewardOutput = self.reward_fn(responses, repeated_answers)
        reward_seconds = time.perf_counter() - started
        experience = Experience.from_generations(
            prompt_ids,
            generations,
            rewards.scores,
            pad_token_id=tokenizer.pad_token_id,
            policy_version=self.engine.policy_version,
            temperature=params.temperature,
            # unique over steps and ranks: (step, rank) numbers the blocks of len(prompts) ids
            group_offset=(step * trainer.world_size + trainer.global_rank) * len(prompts),
            response_width=params.max_tokens,
        )
        lengths = masked_count(experience.response_mask, dim=-1)
        finished = [g.finish_reason == "stop" for group in generations for g in group]
        scores = torch.tensor(rewards.scores)
        metrics = {
            "rollout/response_length_mean": lengths.mean().item(),
            "rollout/response_length_max": lengths.max().item(),
            "rollout/stop_fraction": sum(finished) / len(finished),
            "rollout/tokens_per_second": lengths.sum().item() / max(generate_seconds, 1e-9),
            "rollout/policy_version": float(self.engine.policy_version),
            "reward/mean": scores.mean().item(),
            "reward/accuracy": (scores >= 1.0).float().mean().item(),
            "reward/malformed_fraction": rewards.num_malformed / len(responses),
            "reward/error_fraction": rewards.num_errors / len(responses),
            "reward/timeout_fraction": rewards.num_timeouts / len(responses),
            "timing/generate": generate_seconds,
            "timing/reward": reward_seconds,
        }
        if self.filter_groups:
            informative = informative_samples(experience.scores, experience.group_ids)
            if informative.any():
                experience = experience.select(informative.nonzero().squeeze(1))
            metrics["rollout/filtered_groups_fraction"] = 1.0 - len(experience) / len(responses)
        texts = [
            f"{prompts[i // params.n]!r} → {responses[i]!r} "
            f"(answer {repeated_answers[i]!r}, score {rewards.scores[i]})"
            for i in range(0, len(responses), params.n)
        ]
        return RolloutResult(experience, metrics, texts)

    def evaluate(self, trainer: L.Trainer, host: RolloutHost) -> dict[str, float]:
        """``val/accuracy``, ``val/reward`` (and ``val/pass@k``) on the validation prompts, logged."""
        datamodule = trainer.datamodule
        pass_k_params = None
        if self.validation.pass_k > 1:
            pass_k_params = dataclasses.replace(self.sampling, n=self.validation.pass_k, seed=self.run_seed)
        metrics = evaluate(
            self.engine,
            host.tokenizer,
            datamodule.val_dataloader() if datamodule is not None else [],
            self.reward_fn,
            max_tokens=self.sampling.max_tokens,
            add_special_tokens=prompt_special_tokens(datamodule),
            pass_k_params=pass_k_params,
            device=host.device,
        )
        if metrics:
            publish(trainer, metrics)
        return metrics
