"""OffPolicyModule: the LightningModule that holds actor, critic and reference and runs the RL update."""

from __future__ import annotations

import contextlib
import time

import lightning as L
import torch
from lightning.pytorch.strategies import DeepSpeedStrategy
from torch import Tensor, nn

from lit_offpolicy.advantages import ADVANTAGES, GRPO, Advantage, RunningMoments
from lit_offpolicy.advantages.distillation import distillation_advantages, reverse_kl
from lit_offpolicy.core.attention import without_cudnn_attention
from lit_offpolicy.core.distributed import reduce_metrics
from lit_offpolicy.core.experience import Experience
from lit_offpolicy.core.flops import model_peak_flops, rl_stage_metrics, seconds_since
from lit_offpolicy.core.memory import map_large_blocks, release_freed_heap, step_peak_memory
from lit_offpolicy.core.records import OldLogProbs, StepRecord
from lit_offpolicy.correction import RolloutCorrection, resolve_rollout_correction
from lit_offpolicy.losses import POLICY_LOSSES, PPO, PolicyLoss, kl_controller
from lit_offpolicy.models import check_attn_implementation, load_tokenizer
from lit_offpolicy.models.lora import LoraOptions
from lit_offpolicy.training import sequence_parallel
from lit_offpolicy.training.checkpointing import restore_training_state, set_rng_state, training_state
from lit_offpolicy.training.checks import check_attention_device, check_ckpt, check_components, check_options
from lit_offpolicy.training.compiling import CompiledBlocks
from lit_offpolicy.training.filled import fill
from lit_offpolicy.training.forward import LOGPROB_CHUNK_SIZE
from lit_offpolicy.training.frozen import checked_source, frozen_passes, old_log_probs_sources
from lit_offpolicy.training.hyperparameters import recorded_arguments
from lit_offpolicy.training.loading import load_models, load_teacher
from lit_offpolicy.training.loss_mask import loss_mask, truncated_responses
from lit_offpolicy.training.numerics import NonFiniteGuard
from lit_offpolicy.training.optim import optimizer_and_schedule
from lit_offpolicy.training.options import (
    AdvantageShaping,
    DistillOptions,
    KLOptions,
    LossOptions,
    OptimOptions,
    RewardShaping,
    UpdateOptions,
    as_group,
)
from lit_offpolicy.training.passes import Passes
from lit_offpolicy.training.shaping import estimate_advantages, gather_batch, shape_rewards
from lit_offpolicy.training.shared_prefix import check_option as check_shared_prefix
from lit_offpolicy.training.step_metrics import MetricMeans
from lit_offpolicy.training.strategy import check_strategy, clip_grad_norm, configure_deepspeed, shard_fsdp2
from lit_offpolicy.training.update import (
    accumulated_loss,
    in_sample_order,
    micro_batch_groups,
    micro_batch_terms,
    mini_batches,
    step_experience,
)


class OffPolicyModule(L.LightningModule):
    """Actor π_θ, optional critic and frozen reference, trained off-policy: ``prepare``, then ``update``.

    Args:
        model_path: local HuggingFace directory of the actor (and tokenizer).
        policy_loss: a PolicyLoss, a short name ("ppo", "vanilla", "tis", "topr", ...) or "pkg.module:Name".
        advantage: an Advantage estimator, a short name ("gae", "grpo", "rloo", ...) or an import path.
        rollout_correction: a RolloutCorrection, a preset name ("seq_is_rs") or None (diagnostics only).
        critic_path: directory to initialize the critic from (a value head on that backbone); None: none.
        reference_path: directory of the frozen reference; None: ``model_path`` where a KL term needs it.
        dtype: parameter dtype of the loaded models ("float32" or "bfloat16").
        gradient_checkpointing: recompute each block of actor and critic in the backward.
        logprob_chunk_size: response tokens per LM-head chunk for log-probs and entropy; None: all at once.
        padding_free: pack each micro-batch's samples into one row without padding (same results).
        compile: torch.compile each transformer block for the training step's passes.
        attn_implementation: transformers' attention kernel ("eager", "sdpa", "flash_attention_2", ...).
        lora: train LoRA adapters on the actor (``LoraOptions``); None: full fine-tuning.
        loss: weights of the loss terms (``LossOptions``).
        kl: KL to the reference as a loss term or a reward penalty (``KLOptions``).
        distill: on-policy distillation from a frozen teacher (``DistillOptions``); off by default.
        reward_shaping: score normalization and clipping, DAPO's overlong shaping (``RewardShaping``).
        advantage_shaping: advantage whitening and clipping (``AdvantageShaping``).
        update: epochs, mini- and micro-batch sizes of the update (``UpdateOptions``).
        optim: AdamW, learning-rate schedule and gradient clipping (``OptimOptions``).
        max_consecutive_nonfinite: non-finite optimizer steps in a row (each skipped) that stop the run.
    """

    def __init__(
        self,
        model_path: str,
        policy_loss: PolicyLoss | str | None = None,
        advantage: Advantage | str | None = None,
        rollout_correction: RolloutCorrection | str | None = None,
        critic_path: str | None = None,
        reference_path: str | None = None,
        dtype: str = "float32",
        gradient_checkpointing: bool = False,
        logprob_chunk_size: int | None = LOGPROB_CHUNK_SIZE,
        padding_free: bool = False,
        compile: bool = False,
        attn_implementation: str | None = None,
        lora: LoraOptions | None = None,
        loss: LossOptions = LossOptions(),
        kl: KLOptions = KLOptions(),
        distill: DistillOptions = DistillOptions(),
        reward_shaping: RewardShaping = RewardShaping(),
        advantage_shaping: AdvantageShaping = AdvantageShaping(),
        update: UpdateOptions = UpdateOptions(),
        optim: OptimOptions = OptimOptions(),
        max_consecutive_nonfinite: int = 5,
    ) -> None:
        given = dict(locals())  # the arguments as passed, before any is resolved: what the checkpoint records
        super().__init__()
        map_large_blocks()  # freed activations go back to the kernel, not into the heap (core.memory)
        self.automatic_optimization = False
        self.policy_loss = POLICY_LOSSES.resolve(policy_loss if policy_loss is not None else PPO())
        self.advantage = ADVANTAGES.resolve(advantage if advantage is not None else GRPO())
        # None still measures the π_old / π_rollout gap (rollout_corr/* metrics), correcting nothing
        self.correction = resolve_rollout_correction(rollout_correction) or RolloutCorrection.disabled()
        self.loss_options, self.kl = as_group(LossOptions, loss), as_group(KLOptions, kl)
        self.distill = as_group(DistillOptions, distill)
        self.reward_shaping = as_group(RewardShaping, reward_shaping)
        self.advantage_shaping = as_group(AdvantageShaping, advantage_shaping)
        self.update_options, self.optim = as_group(UpdateOptions, update), as_group(OptimOptions, optim)
        self.model_path, self.model_dtype = model_path, dtype  # RolloutHost: what the engines load
        self.logprob_chunk_size, self.padding_free = logprob_chunk_size, padding_free
        self.compile_enabled = compile
        self.attn_implementation = check_attn_implementation(attn_implementation)
        self.lora = None if lora is None else as_group(LoraOptions, lora)
        chunk, attention = logprob_chunk_size, self.attn_implementation
        check_options(dtype, max_consecutive_nonfinite, padding_free, compile, attention, chunk)
        check_components(self.advantage, self.policy_loss, self.correction, critic_path)
        self.save_hyperparameters(recorded_arguments(given, self))  # what load_from_checkpoint rebuilds
        self.nonfinite_guard = NonFiniteGuard(max_consecutive_nonfinite)
        self._restored_rng: dict | None = None
        self.tokenizer = load_tokenizer(model_path)
        options = (self.kl.needs_reference, self.lora, dtype, gradient_checkpointing, attn_implementation)
        models = load_models(model_path, critic_path, reference_path, *options)
        self.actor, self.critic, self.reference = models.actor, models.critic, models.reference
        self.reference_is_base = models.reference_is_base  # π_ref: the actor with its adapters disabled
        self.teacher = load_teacher(self.distill, self.tokenizer, dtype, attn_implementation)
        check_shared_prefix(self.update_options, self.actor, self.critic, self.reference, self.teacher)
        self.kl_ctl = kl_controller(self.kl.init_coef, self.kl.target, self.kl.horizon)
        self.reward_moments = RunningMoments()
        self.compiled: CompiledBlocks | None = None  # built in configure_model, after any sharding
        # policy_version counts RL steps (weight versions); trainer.global_step counts optimizer steps
        self.policy_version = 0
        self.last_step: StepRecord | None = None  # what callbacks read after a step (RolloutHost)
        self.sequence: sequence_parallel.SequenceGroup | None = None  # update.sequence_parallel's, from setup
        self.frozen_stage: tuple[list[tuple[nn.Module, int]], float, list[int] | None] = ([], 0.0, None)
        """The last frozen passes, for ``stage_perf``: (model, forwards), seconds, shared prompts."""

    def setup(self, stage: str) -> None:
        """Check the strategy and the attention on its device; DeepSpeed clips gradients in its step."""
        if self._trainer is not None:
            check_strategy(self.trainer.strategy)
            check_attention_device(self.attn_implementation, self.trainer.strategy.root_device)
            configure_deepspeed(self.trainer.strategy, self.optim.max_grad_norm)
            models = [self.actor, self.critic, self.reference, self.teacher]
            size, compiling = self.update_options.sequence_parallel, self.compile_enabled
            self.sequence = sequence_parallel.start(size, models, self.trainer.strategy, compiling)

    def configure_model(self) -> None:
        """Shard actor, critic and reference under FSDP2 (``shard_fsdp2``), then compile their blocks."""
        if self._trainer is not None:
            shard_fsdp2(self.trainer.strategy, self)
        if self.compile_enabled and self.compiled is None:
            self.compiled = CompiledBlocks(self.actor, self.critic, self.reference, self.teacher)

    def on_fit_start(self) -> None:
        """Measure the device's peak for ``perf/mfu/*`` now, before a rollout thread shares the cores."""
        model_peak_flops(self.actor)

    def configure_optimizers(self):
        """AdamW over actor and critic, scheduled over ``trainer.max_steps`` (``optimizer_and_schedule``)."""
        total = self.trainer.max_steps if self.trainer and self.trainer.max_steps > 0 else None
        wrapped = isinstance(self.trainer.strategy, DeepSpeedStrategy)
        return optimizer_and_schedule(self.actor, self.critic, self.optim, total, wrapped)

    def training_step(self, batch: dict, batch_idx: int) -> None:
        """One RL step on the batch's experience: ``prepare``, ``update``, then ``last_step``, the metrics."""
        exp = step_experience(batch).to(self.device)
        if self.sequence is not None:  # a sequence group trains on its ranks' rollouts together
            exp = sequence_parallel.joined_experience(exp, self.sequence, self.tokenizer.pad_token_id)
            exp = exp.to(self.device)
        source = self.old_log_probs_source(len(exp))
        version_before = self.policy_version
        with self.compiled.active() if self.compiled is not None else contextlib.nullcontext():
            started = time.perf_counter()
            metrics = self.prepare(exp, source)
            metrics["timing/prepare"] = time.perf_counter() - started
            started = time.perf_counter()
            with without_cudnn_attention():  # its backward's NaN (core.attention)
                metrics.update(self.update(exp, source))
            metrics["timing/update"] = seconds_since(started, self.device)
        metrics.update(self.stage_perf(exp, metrics["timing/update"]))
        self.policy_version += 1
        self.last_step = StepRecord(exp, version_before, self.policy_version, source)
        metrics["actor/policy_version"] = float(self.policy_version)
        metrics["actor/old_log_probs_source"] = source.code
        metrics.update(step_peak_memory(self.device))
        started = time.perf_counter()
        if release_freed_heap():
            metrics["timing/heap_trim"] = time.perf_counter() - started
        self.log_dict(reduce_metrics(metrics, self.device), on_step=True, batch_size=len(exp))

    @torch.no_grad()
    def prepare(self, exp: Experience, source: OldLogProbs | None = None) -> dict[str, float]:
        """Fill π_old, π_ref, values, advantages, returns, loss mask and IS weights of ``exp``, in place.

        ``source``: π_old's (``old_log_probs_source``); None: the one needing no update. With ``UPDATE``
        the update fills π_old off its forward, then the loss mask, IS weights and ``rollout_corr/*``."""
        micro = self.micro_batches(exp)
        update, old_before_update = self.update_options, self.distill.enabled
        source = checked_source(source, len(exp), self.correction, update, self.kl, old_before_update)
        started = time.perf_counter()
        frozen = frozen_passes(exp, source, micro, self._passes())
        frozen_seconds = seconds_since(started, self.device)
        # batch-level statistics over every rank's samples (a collective); each rank keeps its own rows
        batch = gather_batch(exp, frozen, self.kl, self.sequence and self.sequence.data_group)
        rewards = shape_rewards(batch, self.reward_shaping, self.reward_moments, self.kl_ctl.value)
        if rewards.reward_kl is not None:  # β for the next step, as ROLL and verl
            self.kl_ctl.update(rewards.reward_kl, n_steps=len(batch.scores))
        shaped = estimate_advantages(self.advantage, batch, rewards.rewards, self.advantage_shaping)
        metrics = rewards.metrics | shaped.metrics
        advantages = batch.own(shaped.advantages)
        if frozen.teacher_log_probs is not None:
            student, teacher, mask = frozen.old_log_probs, frozen.teacher_log_probs, exp.response_mask
            coef, task_coef = self.distill.coef, self.distill.task_coef
            advantages = distillation_advantages(advantages, student, teacher, mask, coef, task_coef)
            metrics["distill/reverse_kl"] = reverse_kl(student, teacher, mask).item()
        truncated = truncated_responses(exp, self.reward_shaping.mask_truncated)
        if truncated is not None:
            metrics["actor/masked_truncated_fraction"] = truncated.float().mean().item()
        masked = loss_mask(exp, frozen.old_log_probs, self.correction, truncated)
        fill(
            exp,
            old_log_probs=frozen.old_log_probs,
            ref_log_probs=frozen.ref_log_probs,
            values=frozen.values,
            advantages=advantages,
            returns=batch.own(shaped.returns),
            loss_mask=masked.loss_mask,
            is_weights=masked.is_weights,
        )
        self.frozen_stage = ([(model, 1) for model in frozen.forwards], frozen_seconds, frozen.shared_prompts)
        return metrics | masked.metrics

    def old_log_probs_source(self, batch_size: int) -> OldLogProbs:
        """Where this step's π_old comes from, decided once per step (``old_log_probs_sources``): π_rollout
        in bypass mode, else read off the update's forward where that is exact, else a no-grad pass."""
        update, old_before_update = self.update_options, self.distill.enabled
        return old_log_probs_sources(batch_size, self.correction, update, self.kl, old_before_update)[-1]

    def micro_batches(self, exp: Experience) -> list[Tensor]:
        """``exp``'s samples (a mini-batch, or the step's batch) in micro-batches: ``micro_batch_groups``."""
        return micro_batch_groups(exp, self.update_options, self.device)

    def stage_perf(self, exp: Experience, update_seconds: float) -> dict[str, float]:
        """``timing/frozen`` and ``perf/*`` of the frozen passes (``frozen_stage``) and the update."""
        trained, epochs = (self.actor, self.critic), self.update_options.ppo_epochs
        share = 1.0 / (self.sequence.size if self.sequence else 1)  # of each row, on this rank
        return rl_stage_metrics(exp, self.frozen_stage, trained, epochs, update_seconds, share)

    def _passes(self) -> Passes:
        """The models of this step's passes, as they are now (after any sharding or compiling)."""
        models = (self.actor, self.critic, self.reference, self.reference_is_base)
        options = (self.logprob_chunk_size, self.padding_free, self.teacher, self.policy_version)
        return Passes(*models, *options, self.sequence, self.update_options.shares_prefixes)

    def update(self, exp: Experience, source: OldLogProbs = OldLogProbs.RECOMPUTE) -> dict[str, float]:
        """``ppo_epochs`` × mini-batches of optimizer steps with exact gradient accumulation; with
        ``source`` ``OldLogProbs.UPDATE`` π_old is read off the forward (``old_log_probs_source``)."""
        optimizer, scheduler = self.optimizers(), self.lr_schedulers()
        means = MetricMeans()  # read once, after the last optimizer step: no host sync per micro-batch
        mode, value_coef = self.policy_loss.loss_agg_mode, self.loss_options.value_coef
        skipped, old_from_update = 0, source is OldLogProbs.UPDATE
        old_parts: list[tuple[Tensor, Tensor]] = []  # (samples, π_old) of each micro-batch
        for mini in mini_batches(exp, self.update_options, int(self.global_step)):
            optimizer.zero_grad()
            mini_loss = torch.zeros((), device=self.device)
            for group in self.micro_batches(mini):
                micro = mini.select(group.to(self.device))
                actor_loss, critic_loss, micro_metrics = self.micro_batch_loss(micro, old_from_update)
                if old_from_update:
                    old_parts.append((group, micro.old_log_probs))
                loss = accumulated_loss(actor_loss, critic_loss, micro, mini, mode, value_coef)
                self.manual_backward(loss * (self.sequence.size if self.sequence else 1))  # DDP's mean
                mini_loss = mini_loss + loss.detach()
                means.add_all(micro_metrics)
            if not self._step_is_finite(mini_loss, optimizer, mini):
                optimizer.zero_grad()  # skip: no optimizer or scheduler step
                skipped += 1
                continue
            if self.optim.max_grad_norm is not None:
                grad_norm = self.clip_gradients_norm(optimizer, self.optim.max_grad_norm)
                if grad_norm is not None:  # None: DeepSpeed clips inside its step
                    means.add("actor/grad_norm", grad_norm)
            optimizer.step()
            scheduler.step()
        metrics = means.means()
        if old_from_update:  # one mini-batch, not shuffled: π_old back in exp's order, then the correction
            old = in_sample_order(old_parts, self.device)
            truncated = truncated_responses(exp, self.reward_shaping.mask_truncated)
            masked = loss_mask(exp, old, self.correction, truncated)
            fill(exp, old_log_probs=old, loss_mask=masked.loss_mask, is_weights=masked.is_weights)
            metrics.update(masked.metrics)
        metrics["actor/lr"] = scheduler.get_last_lr()[0]
        metrics["actor/nonfinite_skipped"] = float(skipped)
        return metrics

    def _step_is_finite(self, loss: Tensor, optimizer, batch: Experience) -> bool:
        """The NaN/Inf guard (``NonFiniteGuard``), agreed over all processes; raises after too many."""
        parameters = [p for group in optimizer.param_groups for p in group["params"]]
        reduce = self.trainer.strategy.reduce_boolean_decision
        return self.nonfinite_guard.is_finite(loss, parameters, batch, reduce=reduce)

    def clip_gradients_norm(self, optimizer, max_norm: float) -> Tensor | None:
        """Clip the global gradient norm through the strategy (``distributed.clip_grad_norm``); return
        the norm before clipping, or None where the strategy clips inside its step (DeepSpeed)."""
        params = [p for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        return clip_grad_norm(self._trainer and self._trainer.strategy, params, max_norm)

    def micro_batch_loss(
        self, micro: Experience, old_from_update: bool = False
    ) -> tuple[Tensor, Tensor | None, dict[str, Tensor | float]]:
        """The actor's loss and the critic's value loss of one micro-batch, and their metrics
        (``micro_batch_terms``); ``old_from_update``: π_old := π_θ.detach() of this forward."""
        components = (self.policy_loss, self.correction, self.loss_options, self.kl)
        terms = micro_batch_terms(micro, self._passes(), *components, old_from_update)
        if old_from_update:  # π_old = π_θ before the step's only optimizer step
            fill(micro, old_log_probs=terms.old_log_probs)
        return terms.actor, terms.critic, terms.metrics

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        """Keep the policy version, the KL controller, the reward moments, the NaN guard, the RNG states."""
        checkpoint["lit_offpolicy"] = training_state(self)

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        """Refuse another setup's weights (``check_ckpt``), restore ``on_save_checkpoint``'s state."""
        check_ckpt(checkpoint, self)
        self._restored_rng = restore_training_state(self, checkpoint.get("lit_offpolicy", {}))

    def on_train_start(self) -> None:
        """Put back the checkpoint's RNG states, after Lightning's data-loader set-up has drawn its seed."""
        if self._restored_rng is not None:
            set_rng_state(self._restored_rng)
            self._restored_rng = None
