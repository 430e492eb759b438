"""The Rollout callback: generates each training step's experience and evaluates the policy."""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager

import lightning as L
import torch

from lit_offpolicy.checks import check_choice, check_range
from lit_offpolicy.data import prompt_special_tokens
from lit_offpolicy.distributed import RANK_SEED_STRIDE, full_state_dict, params_sharded, reduce_metrics
from lit_offpolicy.evaluation import AccuracyTarget, evaluate, publish
from lit_offpolicy.experience import Experience
from lit_offpolicy.masked import masked_count
from lit_offpolicy.models import load_actor
from lit_offpolicy.rewards import IsolatedReward, RewardOutput, get_reward_fn
from lit_offpolicy.rollout import HFEngine, RolloutEngine, SamplingParams, VLLMEngine
from lit_offpolicy.tensorboard import tensorboard_experiments

ENGINES = ("hf", "vllm")


class Rollout(L.Callback):
    """Synchronous rollouts: sample ``n_samples_per_prompt`` responses per prompt, score them, train.

    At each training batch (a list of prompts and answers from the data module) the engine samples,
    the reward function scores, and ``batch["experience"]`` receives an :class:`Experience` for the
    module's ``training_step``. Every ``sync_every`` RL steps the actor's weights are pushed to the
    engine (version = RL steps done). Every ``val_every_n_steps`` RL steps, and once before the first,
    the validation prompts are answered greedily: ``val/accuracy`` (exact-match rate) and
    ``val/reward`` (mean score); with ``val_pass_k`` > 1 also ``val/pass@k`` from k samples at
    ``temperature``.

    Args:
        engine: "hf" (transformers ``generate``) or "vllm" (an in-process ``vllm.LLM``, see
            ``VLLMEngine``; it loads the actor's directory, then receives the actor's weights).
        vllm_kwargs: ``VLLMEngine`` arguments (max_model_len, gpu_memory_utilization,
            tensor_parallel_size, enable_sleep_mode, ...); dtype defaults to the module's.
        colocate: put the vLLM engine to sleep while the trainer works (weights offloaded, KV cache
            freed) and wake it to generate, sync and evaluate, so actor and engine share one GPU.
            Needs ``vllm_kwargs: {enable_sleep_mode: true}`` on a GPU; a warned no-op on CPU.
        n_samples_per_prompt: responses per prompt (the group size of GRPO/RLOO).
        temperature, top_p, top_k, max_response_length: sampling (temperature 0 is greedy).
        sync_every: RL steps between weight pushes; 1 keeps rollouts on-policy.
        reward: "exact" or "boxed" (see ``lit_offpolicy.rewards``).
        reward_timeout: seconds a batch's scoring may take; the reward runs in ``reward_workers``
            processes (``IsolatedReward``) and a sample that raises or runs out of time scores 0,
            counted in ``reward/error_fraction`` and ``reward/timeout_fraction``. None: in-process.
        reward_start_method: how the reward workers start: "fork" (fast; the workers run one torch
            thread) or "forkserver"/"spawn" (fresh interpreters, for rewards that start threads or
            use CUDA themselves; the reward must then be importable by module path).
        val_every_n_steps: RL steps between evaluations; None or 0 turns them off.
        val_pass_k: samples per validation prompt for pass@k (1: greedy accuracy only).
        stop_at, stop_after: stop training once ``val/accuracy`` has been at least ``stop_at`` at
            ``stop_after`` consecutive evaluations (None: train for ``trainer.max_steps``).
        log_samples_every_n_steps: RL steps between sample generations written to TensorBoard as text.
        seed: sampling seed (each RL step uses seed + step + rank × 1_000_003, so data-parallel
            ranks never sample with the same seed); None takes the run's ``seed_everything`` and
            samples unseeded only when the run has none.

    Under data parallelism (DDP, FSDP, DeepSpeed) every rank has its own engine and samples its own
    prompts (the data module shards them); group ids are unique across ranks; ``rollout/*`` and
    ``reward/*`` metrics are reduced over the ranks (``lit_offpolicy.distributed.reduce_metrics``);
    the sync gathers the actor's full weights on every rank first (``full_state_dict``). Where the
    strategy shards parameters (FSDP, ZeRO-3) the HF engine samples from its own full copy.
    """

    def __init__(
        self,
        engine: str = "hf",
        vllm_kwargs: dict | None = None,
        colocate: bool = False,
        n_samples_per_prompt: int = 8,
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = -1,
        max_response_length: int = 16,
        sync_every: int = 1,
        reward: str = "exact",
        reward_timeout: float | None = 60.0,
        reward_workers: int = 1,
        reward_start_method: str = "fork",
        val_every_n_steps: int | None = 10,
        val_pass_k: int = 1,
        stop_at: float | None = None,
        stop_after: int = 1,
        log_samples_every_n_steps: int = 10,
        seed: int | None = None,
    ) -> None:
        self.engine_name = check_choice("engine", engine, ENGINES)
        self.vllm_kwargs = dict(vllm_kwargs or {})
        if colocate and engine != "vllm":
            raise ValueError(
                f"colocate=True needs engine='vllm' (the HF engine is the actor itself); got {engine!r}"
            )
        self.colocate = colocate
        self.sampling = SamplingParams(
            n=n_samples_per_prompt,
            temperature=temperature,
            top_p=top_p,
            top_k=top_k,
            max_tokens=max_response_length,
        )
        self.sync_every = check_range("sync_every", sync_every, low=1)
        self.reward_fn = get_reward_fn(reward)
        if reward_timeout is not None:
            self.reward_fn = IsolatedReward(
                self.reward_fn, reward_timeout, reward_workers, start_method=reward_start_method
            )
        self.val_every_n_steps = check_range("val_every_n_steps", val_every_n_steps or 0, low=0)
        if self.val_every_n_steps % self.sync_every:
            raise ValueError(
                f"val_every_n_steps={val_every_n_steps} must be a multiple of sync_every={sync_every}: "
                "evaluation uses the engine, which holds the actor's weights only right after a sync"
            )
        self.val_pass_k = check_range("val_pass_k", val_pass_k, low=1)
        if stop_at is not None and not self.val_every_n_steps:
            raise ValueError(f"stop_at={stop_at} needs evaluations: set val_every_n_steps (got {val_every_n_steps})")
        self.target = None if stop_at is None else AccuracyTarget(stop_at, stop_after)
        self.log_samples_every_n_steps = check_range(
            "log_samples_every_n_steps", log_samples_every_n_steps, low=0
        )
        self.seed = seed
        self.engine: RolloutEngine | None = None

    # ----------------------------------------------------------------- lifecycle

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.engine_name == "vllm":
            kwargs = {"dtype": pl_module.hparams.dtype, **self.vllm_kwargs}
            self.engine = VLLMEngine(pl_module.hparams.model_path, **kwargs)
            # the directory holds the initial weights; the actor may already differ (resume, warm start)
            self.engine.load_weights(full_state_dict(trainer.strategy, pl_module), pl_module.policy_version)
            return
        tokenizer = pl_module.tokenizer
        sharded = params_sharded(trainer.strategy)
        # a sharded actor cannot generate on its own: the engine gets a full copy, then the weights
        dtype = getattr(torch, pl_module.hparams.dtype)
        model = (
            load_actor(pl_module.hparams.model_path, dtype).to(pl_module.device)
            if sharded
            else pl_module.actor
        )
        self.engine = HFEngine(
            model,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
            copy_model=self._engine_copies_actor() or sharded,
        )
        if sharded:
            self.engine.load_weights(full_state_dict(trainer.strategy, pl_module), pl_module.policy_version)
        self.engine.policy_version = pl_module.policy_version

    @property
    def run_seed(self) -> int | None:
        """``seed``, or where it is None the run's ``seed_everything`` (Lightning's ``PL_GLOBAL_SEED``)."""
        if self.seed is None and "PL_GLOBAL_SEED" in os.environ:
            return int(os.environ["PL_GLOBAL_SEED"])
        return self.seed

    def state_dict(self) -> dict:
        return {"target_held": self.target.held if self.target is not None else 0}

    def load_state_dict(self, state_dict: dict) -> None:
        if self.target is not None:
            self.target.held = int(state_dict.get("target_held", 0))

    def _engine_copies_actor(self) -> bool:
        """Whether the HF engine samples from its own copy of the actor (weights behind between syncs)."""
        return self.sync_every > 1

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.val_every_n_steps:
            self.evaluate(trainer, pl_module)
        if self.colocate:
            self.engine.sleep()

    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: dict, batch_idx: int
    ):
        with self._engine_awake():
            experience, metrics, texts = self.rollout(pl_module, batch["prompt"], batch["answer"])
        batch["experience"] = experience
        self._log_step(trainer, pl_module, metrics, len(experience), texts)

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs, batch, batch_idx):
        version = pl_module.policy_version
        sync = version % self.sync_every == 0
        evaluate = self.val_every_n_steps and version % self.val_every_n_steps == 0
        if not (sync or evaluate):
            return
        with self._engine_awake():
            if sync:
                started = time.perf_counter()
                self.engine.load_weights(full_state_dict(trainer.strategy, pl_module), version)
                pl_module.log("timing/weight_sync", time.perf_counter() - started, on_step=True, batch_size=1)
            if evaluate:
                self.evaluate(trainer, pl_module)

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if isinstance(self.reward_fn, IsolatedReward):
            self.reward_fn.close()

    @contextmanager
    def _engine_awake(self) -> Iterator[None]:
        """With ``colocate``: wake the engine for the block, put it back to sleep after."""
        if not self.colocate:
            yield
            return
        self.engine.wake_up()
        try:
            yield
        finally:
            self.engine.sleep()

    # ----------------------------------------------------------------- work

    def rollout(
        self, pl_module: L.LightningModule, prompts: list[str], answers: list[str], step: int | None = None
    ) -> tuple[Experience, dict[str, float], list[str]]:
        """Sample, score and pack one batch; returns the experience, its metrics and a few sample texts.

        ``step`` numbers the batch for the sampling seed (seed + step) and the group ids; None uses
        the module's policy version (the synchronous path, where batch and version coincide).
        """
        tokenizer = pl_module.tokenizer
        prompt_ids = self._tokenize(pl_module, prompts)
        step = pl_module.policy_version if step is None else step
        params = self.sampling
        trainer = pl_module.trainer
        if self.run_seed is not None:
            seed = self.run_seed + step + trainer.global_rank * RANK_SEED_STRIDE
            params = dataclasses.replace(params, seed=seed)
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
        texts = [
            f"{prompts[i // params.n]!r} → {responses[i]!r} "
            f"(answer {repeated_answers[i]!r}, score {rewards.scores[i]})"
            for i in range(0, len(responses), params.n)
        ]
        return experience, metrics, texts

    def evaluate(self, trainer: L.Trainer, pl_module: L.LightningModule) -> dict[str, float]:
        """Greedy exact-match accuracy (and pass@k) on the data module's validation prompts."""
        datamodule = trainer.datamodule
        pass_k_params = None
        if self.val_pass_k > 1:
            pass_k_params = dataclasses.replace(self.sampling, n=self.val_pass_k, seed=self.run_seed)
        metrics = evaluate(
            self.engine,
            pl_module.tokenizer,
            datamodule.val_dataloader() if datamodule is not None else [],
            self.reward_fn,
            max_tokens=self.sampling.max_tokens,
            add_special_tokens=prompt_special_tokens(datamodule),
            pass_k_params=pass_k_params,
            device=pl_module.device,
        )
        if metrics:
            publish(trainer, metrics)
            if self.target is not None and self.target.reached(metrics["val/accuracy"]):
                trainer.should_stop = True
        return metrics

    def _tokenize(self, pl_module: L.LightningModule, prompts: list[str]) -> list[list[int]]:
        add_special_tokens = prompt_special_tokens(pl_module.trainer.datamodule)
        return pl_module.tokenizer(list(prompts), add_special_tokens=add_special_tokens).input_ids

    def _log_step(
        self,
        trainer: L.Trainer,
        pl_module: L.LightningModule,
        metrics: dict[str, float],
        batch_size: int,
        texts: list[str],
    ) -> None:
        """Log a step's rollout metrics, reduced over the ranks, and every ``log_samples_every_n_steps``
        steps a few sample generations as TensorBoard text."""
        metrics = reduce_metrics(metrics, pl_module.device)  # the same on every rank
        pl_module.log_dict(metrics, on_step=True, batch_size=batch_size)
        every = self.log_samples_every_n_steps
        if every and pl_module.policy_version % every == 0:
            for experiment in tensorboard_experiments(trainer):
                experiment.add_text("rollout/samples", "\n\n".join(texts[:8]), trainer.global_step)
