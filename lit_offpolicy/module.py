"""OffPolicyModule: the LightningModule that holds actor, critic and reference and runs the RL update."""

from __future__ import annotations

import contextlib
import math
import time

import lightning as L
import torch
from torch import Tensor

from lit_offpolicy.advantages import (
    ADVANTAGES,
    GAE,
    GRPO,
    Advantage,
    RunningMoments,
    clip_advantages,
    clip_rewards,
    normalize_rewards,
    overlong_penalty,
    token_level_rewards,
    whiten_advantages,
)
from lit_offpolicy.core.checks import check_choice, check_range
from lit_offpolicy.core.distributed import gather_rows, max_over_ranks, reduce_metrics
from lit_offpolicy.core.experience import Experience
from lit_offpolicy.core.masked import masked_count, masked_mean
from lit_offpolicy.core.memory import step_peak_memory
from lit_offpolicy.core.records import OldLogProbs, StepRecord
from lit_offpolicy.core.registry import component_config
from lit_offpolicy.correction import RolloutCorrection, pure_is_policy_loss, resolve_rollout_correction
from lit_offpolicy.losses import (
    POLICY_LOSSES,
    PPO,
    PolicyLoss,
    Vanilla,
    aggregate,
    kl_controller,
    kl_penalty,
    micro_batch_weight,
    value_loss,
)
from lit_offpolicy.models import (
    check_attn_implementation,
    load_actor,
    load_critic,
    load_reference,
    load_tokenizer,
)
from lit_offpolicy.models.lora import LoraOptions, add_lora
from lit_offpolicy.training.checkpointing import rng_state, set_rng_state
from lit_offpolicy.training.compiling import CompiledBlocks
from lit_offpolicy.training.forward import (
    LOGPROB_CHUNK_SIZE,
    critic_values,
    frozen_log_probs,
    policy_log_probs,
)
from lit_offpolicy.training.micro_batches import by_size, by_token_budget, equalised
from lit_offpolicy.training.numerics import NonFiniteGuard
from lit_offpolicy.training.options import (
    AdvantageShaping,
    KLOptions,
    LossOptions,
    OptimOptions,
    RewardShaping,
    UpdateOptions,
    as_group,
    group_dict,
)
from lit_offpolicy.training.packing import sample_lengths
from lit_offpolicy.training.step_metrics import MetricMeans
from lit_offpolicy.training.strategy import check_strategy, clip_grad_norm, configure_deepspeed, shard_fsdp2


class OffPolicyModule(L.LightningModule):
    """Actor (π_θ), optional critic (value head) and optional frozen reference, updated off-policy.

    Each training step receives ``batch["experience"]`` from the rollout callback and runs (see
    docs/architecture.md, "One training step"): no-grad passes for π_old, the reference and the
    critic; reward shaping and advantages; rollout correction; then ``update.ppo_epochs`` passes over
    shuffled mini-batches of ``update.mini_batch_size`` samples, each accumulated over micro-batches
    of ``update.micro_batch_size`` and followed by one optimizer step. ``trainer.global_step``
    therefore counts optimizer steps; ``policy_version`` counts RL steps (weight versions). The
    finished step is kept as ``last_step`` (a ``StepRecord``) for callbacks.

    Args:
        model_path: local HuggingFace directory of the actor (and tokenizer).
        policy_loss: a PolicyLoss (PPO, Vanilla, TIS, TOPR, CISPO, Kimi15, GSPO, or any subclass by
            class_path), a short name ("ppo", "vanilla", "tis", "topr", "cispo", "kimi15", "gspo") for its
            defaults, or an import path "pkg.module:Name"; default PPO().
        advantage: an Advantage estimator (GAE, Reinforce, GRPO, RLOO, ReinforcePlusPlus, or a subclass),
            a short name ("gae", "reinforce", "grpo", "rloo", "reinforce++") or an import path;
            default GRPO().
        rollout_correction: a RolloutCorrection, a preset name (e.g. "seq_is_rs") or None (no
            correction; the ``rollout_corr/*`` diagnostics are logged all the same).
        critic_path: directory to initialise the critic from (a value head on that backbone); None: no critic.
        reference_path: directory of the frozen reference; None uses ``model_path`` when a KL term needs it.
        dtype: parameter dtype of the loaded models ("float32" or "bfloat16").
        gradient_checkpointing: recompute each transformer block of actor and critic in the
            backward instead of keeping its activations (non-reentrant; the same loss and gradients).
        logprob_chunk_size: apply the LM head to this many response tokens at a time for the
            log-probs and entropy, recomputing each chunk's logits in the backward, so that one chunk's
            logits (chunk × vocabulary) exist at a time instead of all (B, R, V); None: all at once.
        padding_free: every pass (actor, reference, critic) takes a micro-batch's samples packed end to
            end in one row without padding, positions restarting at each sample and attention kept
            within it (``lit_offpolicy.training.packing``): the same log-probs, values and gradients, with no
            compute on padding. Needs attn_implementation "sdpa", "eager" or "flash_attention_2".
        compile: torch.compile each transformer block of actor, critic and reference for the passes of
            the training step (``lit_offpolicy.training.compiling``): the first steps pay the compilation, and
            the results agree with eager to float rounding. Generation, evaluation and export stay eager.
        attn_implementation: transformers' attention kernel for actor, critic and reference, passed to
            ``from_pretrained``: "eager", "sdpa", "flash_attention_2" (needs flash-attn and a CUDA GPU)
            or "flex_attention" (CUDA only for training: no backward on CPU); None: transformers'
            default ("sdpa" where the model has it).
        lora: train LoRA adapters on the actor instead of all its weights (``LoraOptions``: r, alpha,
            dropout, target_modules); the reference is then the actor with its adapters disabled
            (unless ``reference_path`` names another directory); None: full fine-tuning.
        loss: weights of the loss terms (``LossOptions``).
        kl: KL to the reference as a loss term or a reward penalty (``KLOptions``).
        reward_shaping: score normalisation and clipping, DAPO's overlong penalty and filtering
            (``RewardShaping``).
        advantage_shaping: advantage whitening and clipping (``AdvantageShaping``).
        update: epochs, mini- and micro-batch sizes of the update (``UpdateOptions``).
        optim: AdamW, learning-rate schedule and gradient clipping (``OptimOptions``).
        max_consecutive_nonfinite: an optimizer step whose loss or gradient is NaN/Inf is skipped
            and logged (``actor/nonfinite_skipped``); this many in a row stop the run (≥ 1).

    The checkpoint's hyper-parameters keep the components as ``class_path``/``init_args`` and the
    groups as mappings, so ``OffPolicyModule.load_from_checkpoint`` rebuilds the same loss,
    estimator and correction with the same arguments.

    Data parallelism (DDP, FSDP, DeepSpeed): each rank trains on its own rollouts; the batch-level
    statistics of ``prepare`` (reward normalisation, the KL controller, advantages and their
    whitening) are computed over all ranks' samples, as one process holding the whole batch would;
    logged metrics are reduced over the ranks. Mini- and micro-batch sizes are per rank.
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
        reward_shaping: RewardShaping = RewardShaping(),
        advantage_shaping: AdvantageShaping = AdvantageShaping(),
        update: UpdateOptions = UpdateOptions(),
        optim: OptimOptions = OptimOptions(),
        max_consecutive_nonfinite: int = 5,
    ) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.policy_loss = POLICY_LOSSES.resolve(policy_loss if policy_loss is not None else PPO())
        self.advantage = ADVANTAGES.resolve(advantage if advantage is not None else GRPO())
        # None still measures the π_old / π_rollout gap (rollout_corr/* metrics), correcting nothing
        self.correction = resolve_rollout_correction(rollout_correction) or RolloutCorrection.disabled()
        self.loss_options = as_group(LossOptions, loss)
        self.kl = as_group(KLOptions, kl)
        self.reward_shaping = as_group(RewardShaping, reward_shaping)
        self.advantage_shaping = as_group(AdvantageShaping, advantage_shaping)
        self.update_options = as_group(UpdateOptions, update)
        self.optim = as_group(OptimOptions, optim)
        self.model_path, self.model_dtype = model_path, dtype  # RolloutHost: what the engines load
        self.logprob_chunk_size = logprob_chunk_size
        self.padding_free = padding_free
        self.compile_enabled = compile
        self.attn_implementation = check_attn_implementation(attn_implementation)
        self.lora = None if lora is None else as_group(LoraOptions, lora)
        self._validate(critic_path, max_consecutive_nonfinite)
        self.save_hyperparameters(
            {
                "model_path": model_path,
                "policy_loss": component_config(self.policy_loss),
                "advantage": component_config(self.advantage),
                "rollout_correction": component_config(self.correction),
                "critic_path": critic_path,
                "reference_path": reference_path,
                "dtype": dtype,
                "gradient_checkpointing": gradient_checkpointing,
                "logprob_chunk_size": logprob_chunk_size,
                "padding_free": padding_free,
                "compile": compile,
                "attn_implementation": attn_implementation,
                "lora": None if self.lora is None else group_dict(self.lora),
                "loss": group_dict(self.loss_options),
                "kl": group_dict(self.kl),
                "reward_shaping": group_dict(self.reward_shaping),
                "advantage_shaping": group_dict(self.advantage_shaping),
                "update": group_dict(self.update_options),
                "optim": group_dict(self.optim),
                "max_consecutive_nonfinite": max_consecutive_nonfinite,
            }
        )
        self.nonfinite_guard = NonFiniteGuard(max_consecutive_nonfinite)
        self._restored_rng: dict | None = None

        torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
        self.tokenizer = load_tokenizer(model_path)
        attention, checkpointing = attn_implementation, gradient_checkpointing
        self.actor = load_actor(model_path, torch_dtype, checkpointing, attention)
        if self.lora is not None:
            self.actor = add_lora(self.actor, self.lora)
        self.critic = load_critic(critic_path, torch_dtype, checkpointing, attention) if critic_path else None
        needs_reference = self.kl.needs_reference or reference_path is not None
        # with LoRA the actor's base weights are the model_path's: the reference is the actor unadapted
        self.reference_is_base = (
            needs_reference and self.lora is not None and reference_path in (None, model_path)
        )
        self.reference = (
            load_reference(reference_path or model_path, torch_dtype, attention)
            if needs_reference and not self.reference_is_base
            else None
        )
        self.kl_ctl = kl_controller(self.kl.init_coef, self.kl.target, self.kl.horizon)
        self.reward_moments = RunningMoments()
        self.compiled: CompiledBlocks | None = None  # built in configure_model, after any sharding
        self.policy_version = 0
        self.last_step: StepRecord | None = None  # what callbacks read after a step (RolloutHost)

    def _validate(self, critic_path: str | None, max_consecutive_nonfinite: int) -> None:
        """Check the options the groups cannot check alone, before any model is loaded."""
        check_choice("dtype", self.model_dtype, ("float32", "bfloat16"))
        check_range("max_consecutive_nonfinite", max_consecutive_nonfinite, low=1)
        check_choice("padding_free", self.padding_free, (True, False))
        check_choice("compile", self.compile_enabled, (True, False))
        if self.padding_free and self.attn_implementation == "flex_attention":
            raise ValueError(
                "padding_free=True needs an attention that separates packed samples by their positions; "
                "allowed values of attn_implementation with it: None, 'eager', 'sdpa', 'flash_attention_2'"
            )
        chunk = self.logprob_chunk_size
        if chunk is not None and (isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1):
            raise ValueError(
                f"logprob_chunk_size={chunk!r} is not a number of tokens; allowed values: an integer ≥ 1 "
                "(tokens per LM-head chunk) or None (the whole (B, R, V) logits at once)"
            )
        if isinstance(self.advantage, GAE) and critic_path is None:
            raise ValueError(
                "advantage=GAE needs a critic: set critic_path (e.g. to model_path) or use GRPO/RLOO"
            )
        if self.correction.pure_is and type(self.policy_loss) not in (PPO, Vanilla):
            raise ValueError(
                f"rollout_correction in pure-IS mode replaces the policy loss by off-policy REINFORCE; "
                f"policy_loss={type(self.policy_loss).__name__} would be ignored: use PPO or Vanilla "
                "(only its loss_agg_mode is used) or turn pure_is off"
            )

    # ----------------------------------------------------------------- optimisation

    def setup(self, stage: str) -> None:
        if self._trainer is not None:
            check_strategy(self.trainer.strategy)
            device = self.trainer.strategy.root_device
            if self.attn_implementation == "flex_attention" and device.type != "cuda":
                raise ValueError(
                    "attn_implementation='flex_attention' trains on CUDA only (torch's FlexAttention has no "
                    "backward on CPU); allowed values on CPU: None, 'eager', 'sdpa'"
                )
            configure_deepspeed(self.trainer.strategy, self.optim.max_grad_norm)

    def configure_model(self) -> None:
        """Under ``ModelParallelStrategy`` (FSDP2): shard actor, critic and reference (``shard_fsdp2``);
        then, with ``compile``, prepare the compiled blocks."""
        if self._trainer is not None:
            shard_fsdp2(self.trainer.strategy, self)
        if self.compile_enabled and self.compiled is None:
            self.compiled = CompiledBlocks(self.actor, self.critic, self.reference)

    def configure_optimizers(self):
        o = self.optim
        groups = [{"params": [p for p in self.actor.parameters() if p.requires_grad], "lr": o.lr}]
        if self.critic is not None:
            groups.append({"params": list(self.critic.parameters()), "lr": o.critic_lr or o.lr})
        optimizer = torch.optim.AdamW(groups, weight_decay=o.weight_decay)
        total = self.trainer.max_steps if self.trainer and self.trainer.max_steps > 0 else None
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, self._lr_factor(total))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def _lr_factor(self, total_steps: int | None):
        """Linear warm-up, then constant, linear or cosine decay to ``min_lr_ratio`` at ``total_steps``."""
        o = self.optim

        def factor(step: int) -> float:
            if step < o.warmup_steps:
                return (step + 1) / o.warmup_steps
            if o.lr_schedule == "constant" or not total_steps:
                return 1.0
            progress = min(1.0, (step - o.warmup_steps) / max(1, total_steps - o.warmup_steps))
            decay = (
                1.0 - progress if o.lr_schedule == "linear" else 0.5 * (1.0 + math.cos(math.pi * progress))
            )
            return o.min_lr_ratio + (1.0 - o.min_lr_ratio) * decay

        return factor

    def training_step(self, batch: dict, batch_idx: int) -> None:
        if "experience" not in batch:
            raise RuntimeError(
                "the training batch has no 'experience': OffPolicyModule trains on rollouts that a rollout "
                "callback adds to each batch; put lit_offpolicy.callbacks.Rollout in trainer.callbacks"
            )
        exp: Experience = batch["experience"].to(self.device)
        source = self.old_log_probs_source(len(exp))
        version_before = self.policy_version
        with self.compiled.active() if self.compiled is not None else contextlib.nullcontext():
            started = time.perf_counter()
            metrics = self.prepare(exp, source)
            metrics["timing/prepare"] = time.perf_counter() - started
            started = time.perf_counter()
            metrics.update(self.update(exp, source))
            metrics["timing/update"] = time.perf_counter() - started
        self.policy_version += 1
        self.last_step = StepRecord(exp, version_before, self.policy_version, source)
        metrics["actor/policy_version"] = float(self.policy_version)
        metrics["actor/old_log_probs_source"] = source.code
        metrics.update(step_peak_memory(self.device))
        self.log_dict(reduce_metrics(metrics, self.device), on_step=True, batch_size=len(exp))

    # ----------------------------------------------------------------- step stages

    @torch.no_grad()
    def prepare(self, exp: Experience, source: OldLogProbs | None = None) -> dict[str, float]:
        """Fill π_old, reference log-probs, values, advantages, returns, loss mask and IS weights.

        ``source`` is where π_old comes from (``old_log_probs_source``); None: the one that needs no
        update (π_rollout in bypass mode, otherwise the recompute). With ``OldLogProbs.UPDATE``
        π_old is left to ``update``, which reads it off its forward and then logs the
        ``rollout_corr/*`` diagnostics.
        """
        micro, chunk, packed = self.micro_batches(exp), self.logprob_chunk_size, self.padding_free
        allowed = self._old_log_probs_sources(len(exp))
        source = allowed[0] if source is None else source
        if source not in allowed:
            names = ", ".join(repr(s.value) for s in allowed)
            raise ValueError(
                f"old_log_probs={source.value!r} is not supported here (bypass mode takes π_rollout; the "
                "update's forward needs one optimizer step per RL step, no reward KL penalty and no "
                f"loss-changing rollout correction); allowed values: {names}"
            )
        if source is OldLogProbs.ROLLOUT:
            exp.old_log_probs = exp.rollout_log_probs  # bypass mode: π_old := π_rollout
        elif source is OldLogProbs.UPDATE:
            exp.old_log_probs = None  # the update's forward fills it
        else:
            exp.old_log_probs = frozen_log_probs(self.actor, exp, exp.temperature, micro, chunk, packed)
        if self.reference is not None:
            exp.ref_log_probs = frozen_log_probs(self.reference, exp, exp.temperature, micro, chunk, packed)
        elif self.reference_is_base:
            with self.actor.disable_adapter():  # peft: the base model's forward, the same weights
                exp.ref_log_probs = frozen_log_probs(self.actor, exp, exp.temperature, micro, chunk, packed)
        if self.critic is not None:
            order = torch.argsort(torch.cat(micro)).to(exp.response_ids.device)
            parts = [critic_values(self.critic, exp.select(g.to(order.device)), packed) for g in micro]
            exp.values = torch.cat(parts)[order]

        metrics: dict[str, float] = {}
        kl = None
        if self.kl.use_in_reward:
            kl = kl_penalty(exp.old_log_probs, exp.ref_log_probs, self.kl.penalty)
        # batch-level statistics over every rank's samples; each rank keeps its own rows (``mine``)
        # ``mask``: the response tokens; ``policy``: those the policy sampled (all of them without an
        # action mask; multi-turn episodes leave out the environment's observations)
        (scores, group_ids, mask, action, values, kl), mine = gather_rows(
            exp.scores, exp.group_ids, exp.response_mask, exp.action_mask, exp.values, kl
        )
        policy = mask if action is None else mask * action
        shaping = self.reward_shaping
        if shaping.overlong_buffer_length is not None:  # DAPO: before normalisation, as a reward term
            penalty = self._overlong_penalty(masked_count(mask, dim=-1), exp.response_mask.shape[1])
            scores = scores + penalty.to(scores.dtype)
            metrics["reward/overlong_penalty_mean"] = penalty.mean().item()
        scores = normalize_rewards(
            scores,
            reward_norm=shaping.norm,
            group_ids=group_ids,
            running=self.reward_moments,
            reward_shift=shaping.shift,
            reward_scale=shaping.scale,
        )
        scores = clip_rewards(scores, shaping.clip)  # after normalisation, as ROLL
        rewards = token_level_rewards(scores, mask, kl=kl, kl_coef=self.kl_ctl.value, action_mask=action)
        if kl is not None:
            current_kl = masked_mean(kl, policy).item()
            metrics.update({"actor/reward_kl": current_kl, "actor/kl_coef": self.kl_ctl.value})
            self.kl_ctl.update(current_kl, n_steps=len(scores))  # for the next step, as ROLL and verl
        advantages, returns = self.advantage(
            rewards, mask, values=values, group_ids=group_ids, action_mask=action
        )
        if self.advantage_shaping.whiten:
            advantages = whiten_advantages(advantages, policy)
        if self.advantage_shaping.clip is not None:
            advantages, clip_fraction = clip_advantages(advantages, policy, self.advantage_shaping.clip)
            metrics["actor/advantage_clipfrac"] = clip_fraction
        metrics["actor/advantages_mean"] = masked_mean(advantages, policy).item()
        metrics["critic/returns_mean"] = masked_mean(returns, policy).item()
        width = exp.response_mask.shape[1]
        exp.advantages, exp.returns = advantages[mine, :width], returns[mine, :width]

        if shaping.mask_truncated:
            metrics["actor/masked_truncated_fraction"] = self._truncated(exp).float().mean().item()

        if source is OldLogProbs.UPDATE:  # nothing to correct yet: the diagnostics follow the update
            exp.loss_mask, exp.is_weights = self._without_truncated(exp, exp.policy_mask), None
            return metrics
        metrics.update(self._correct(exp))
        return metrics

    def _overlong_penalty(self, lengths: Tensor, max_length: int) -> Tensor:
        """DAPO's soft overlong punishment of each response; L_max is the responses' width, which the
        rollout worker pads to ``sampling.max_tokens``."""
        buffer_length = self.reward_shaping.overlong_buffer_length
        if buffer_length >= max_length:
            raise ValueError(
                f"reward_shaping.overlong_buffer_length={buffer_length} must be smaller than the responses' "
                f"max length (the Rollout callback's sampling.max_tokens={max_length}); allowed values: "
                f"1..{max_length - 1}"
            )
        factor = self.reward_shaping.overlong_penalty_factor
        return overlong_penalty(lengths, max_length, buffer_length, factor)

    def _truncated(self, exp: Experience) -> Tensor:
        if exp.truncated is None:
            raise ValueError(
                "reward_shaping.mask_truncated=True needs each response's finish reason "
                "(Experience.truncated, which Experience.from_generations records); this experience has none"
            )
        return exp.truncated.to(exp.response_mask.device)

    def _without_truncated(self, exp: Experience, mask: Tensor) -> Tensor:
        """``mask`` with the truncated responses' rows zeroed where ``reward_shaping.mask_truncated``."""
        if not self.reward_shaping.mask_truncated:
            return mask
        return torch.where(self._truncated(exp)[:, None], torch.zeros_like(mask), mask)

    def _correct(self, exp: Experience) -> dict[str, float]:
        """Rollout correction of π_old against π_rollout over the policy's tokens (π_rollout exists only
        there): IS weights, loss mask, ``rollout_corr/*``."""
        corrected = self.correction.compute(
            old_log_probs=exp.old_log_probs,
            rollout_log_probs=exp.rollout_log_probs,
            response_mask=exp.policy_mask,
        )
        exp.loss_mask = self._without_truncated(exp, corrected.response_mask)
        exp.is_weights = corrected.is_weights
        return corrected.metrics

    def old_log_probs_source(self, batch_size: int) -> OldLogProbs:
        """Where this step's π_old comes from, decided once per step (see ``OldLogProbs``).

        Bypass mode (``RolloutCorrection.bypass_mode``) takes π_rollout. Otherwise, with one
        optimizer step per RL step (one epoch, one mini-batch) every micro-batch's forward runs on
        the weights π_old is defined by, so π_old = π_θ.detach() exactly (TRL does the same) and the
        no-grad pass before the update is skipped. That holds only
        while π_old is not needed before the update: not for a reward KL penalty, and not for a
        rollout correction that reaches the loss (``RolloutCorrection.changes_the_loss``); the
        ``rollout_corr/*`` diagnostics are then computed after the update from the same π_old.
        Everything else recomputes π_old before the update.
        """
        return self._old_log_probs_sources(batch_size)[-1]

    def _old_log_probs_sources(self, batch_size: int) -> tuple[OldLogProbs, ...]:
        """The sources valid for this configuration and batch, the one needing no update first."""
        if not self.correction.requires_old_log_probs:
            return (OldLogProbs.ROLLOUT,)
        u = self.update_options
        one_step = u.ppo_epochs == 1 and (u.mini_batch_size or batch_size) >= batch_size
        if one_step and not self.kl.use_in_reward and not self.correction.changes_the_loss:
            return (OldLogProbs.RECOMPUTE, OldLogProbs.UPDATE)
        return (OldLogProbs.RECOMPUTE,)

    def micro_batches(self, exp: Experience) -> list[Tensor]:
        """The samples of ``exp`` (a mini-batch, or the step's batch for the no-grad passes) in
        micro-batches, as groups of indices: ``update.micro_batch_size`` samples each, or at most
        ``update.max_tokens_per_micro_batch`` tokens each, as many on every rank (``micro_batches``)."""
        budget = self.update_options.max_tokens_per_micro_batch
        if budget is None:
            return by_size(len(exp), self.update_options.micro_batch_size)
        lengths = sample_lengths(exp).cpu()
        groups = by_token_budget(lengths, budget)
        return equalised(groups, lengths, max_over_ranks(len(groups), self.device))

    def update(self, exp: Experience, source: OldLogProbs = OldLogProbs.RECOMPUTE) -> dict[str, float]:
        """``ppo_epochs`` × mini-batches of optimizer steps with exact gradient accumulation; with
        ``source`` ``OldLogProbs.UPDATE`` π_old is read off the forward (``old_log_probs_source``)."""
        u, max_grad_norm = self.update_options, self.optim.max_grad_norm
        optimizer, scheduler = self.optimizers(), self.lr_schedulers()
        generator = torch.Generator().manual_seed(int(self.global_step))
        means = MetricMeans()  # read once, after the last optimizer step: no host sync per micro-batch
        mode = self.policy_loss.loss_agg_mode
        skipped = 0
        mini_size = u.mini_batch_size or len(exp)
        shuffle = generator if mini_size < len(exp) else None  # one mini-batch: order changes nothing
        old_from_update = source is OldLogProbs.UPDATE
        old_parts: list[Tensor] = []
        old_order: list[Tensor] = []  # the samples of each part
        for _ in range(u.ppo_epochs):
            for mini in exp.split(mini_size, shuffle):
                optimizer.zero_grad()
                mini_loss = torch.zeros((), device=self.device)
                for group in self.micro_batches(mini):
                    micro = mini.select(group.to(self.device))
                    actor_loss, critic_loss, micro_metrics = self.micro_batch_loss(micro, old_from_update)
                    if old_from_update:
                        old_parts.append(micro.old_log_probs)
                        old_order.append(group)
                    weight = micro_batch_weight(micro.loss_mask, mini.loss_mask, mode)
                    loss = actor_loss * weight.to(actor_loss.dtype)
                    if critic_loss is not None:
                        share = micro_batch_weight(micro.policy_mask, mini.policy_mask, "token-mean")
                        loss = loss + self.loss_options.value_coef * critic_loss * share.to(critic_loss.dtype)
                    self.manual_backward(loss)
                    mini_loss = mini_loss + loss.detach()
                    means.add_all(micro_metrics)
                if not self._step_is_finite(mini_loss, optimizer, mini):
                    optimizer.zero_grad()  # skip: no optimizer or scheduler step
                    skipped += 1
                    continue
                if max_grad_norm is not None:
                    grad_norm = self.clip_gradients_norm(optimizer, max_grad_norm)
                    if grad_norm is not None:  # None: DeepSpeed clips inside its step
                        means.add("actor/grad_norm", grad_norm)
                optimizer.step()
                scheduler.step()
        metrics = means.means()
        if old_from_update:  # one mini-batch, not shuffled: back in exp's order
            exp.old_log_probs = torch.cat(old_parts)[torch.argsort(torch.cat(old_order)).to(self.device)]
            metrics.update(self._correct(exp))
        metrics["actor/lr"] = scheduler.get_last_lr()[0]
        metrics["actor/nonfinite_skipped"] = float(skipped)
        return metrics

    def _step_is_finite(self, loss: Tensor, optimizer, batch: Experience) -> bool:
        """The NaN/Inf guard (``NonFiniteGuard``), agreed over all processes; raises after too many."""
        parameters = [p for group in optimizer.param_groups for p in group["params"]]
        return self.nonfinite_guard.is_finite(
            loss, parameters, batch, reduce=lambda ok: self.trainer.strategy.reduce_boolean_decision(ok)
        )

    def clip_gradients_norm(self, optimizer, max_norm: float) -> Tensor | None:
        """Clip the global gradient norm through the strategy (``distributed.clip_grad_norm``); return
        the norm before clipping, or None where the strategy clips inside its step (DeepSpeed)."""
        params = [p for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        strategy = self._trainer.strategy if self._trainer is not None else None
        return clip_grad_norm(strategy, params, max_norm)

    def micro_batch_loss(
        self, micro: Experience, old_from_update: bool = False
    ) -> tuple[Tensor, Tensor | None, dict[str, Tensor | float]]:
        """The actor's loss (policy + KL − entropy bonus) and the critic's value loss of one micro-batch.

        They come apart because they aggregate over different tokens: the actor over ``loss_mask``
        (after rollout correction) in its ``loss_agg_mode``, the critic over all the policy's tokens
        (``policy_mask``: every response token but an episode's observations, whose returns are 0).
        ``old_from_update``: π_old := π_θ.detach() of this forward (``OldLogProbs.UPDATE``).
        """
        weights = self.loss_options
        mask = micro.loss_mask
        with_entropy = weights.entropy_coef > 0
        chunk = self.logprob_chunk_size
        log_probs, entropy = policy_log_probs(
            self.actor, micro, micro.temperature, with_entropy, chunk, self.padding_free
        )
        if old_from_update:  # π_old = π_θ before the step's only optimizer step
            micro.old_log_probs = log_probs.detach()
        if self.correction.pure_is:
            pg = pure_is_policy_loss(
                log_probs=log_probs,
                rollout_log_probs=micro.rollout_log_probs,
                advantages=micro.advantages,
                response_mask=mask,
                rollout_is=self.correction.rollout_is,
                threshold=self.correction.rollout_is_threshold,
                loss_agg_mode=self.policy_loss.loss_agg_mode,
            )
        else:
            pg = self.policy_loss(
                log_probs=log_probs,
                old_log_probs=micro.old_log_probs,
                advantages=micro.advantages,
                response_mask=mask,
                scores=micro.scores,
                is_weights=micro.is_weights,
            )
        loss = weights.rl_coef * pg.loss
        metrics = {f"actor/{name}": value for name, value in pg.metrics.items()}
        mode = self.policy_loss.loss_agg_mode
        if self.kl.use_loss:
            kl_loss = aggregate(kl_penalty(log_probs, micro.ref_log_probs, self.kl.loss_type), mask, mode)
            loss = loss + self.kl.loss_coef * kl_loss
            metrics["actor/kl_loss"] = kl_loss.detach()
        if entropy is not None:
            entropy_loss = aggregate(entropy, mask, mode)
            loss = loss - weights.entropy_coef * entropy_loss
            metrics["actor/entropy"] = entropy_loss.detach()
        if self.critic is None:
            return loss, None, metrics
        values = critic_values(self.critic, micro, self.padding_free)
        critic_loss, vf_metrics = value_loss(
            values,
            micro.values,
            micro.returns,
            micro.policy_mask,
            weights.value_clip,
            loss_agg_mode="token-mean",
        )
        metrics.update({f"critic/{name}": value for name, value in vf_metrics.items()})
        metrics["critic/values_mean"] = masked_mean(values.detach(), micro.policy_mask)
        return loss, critic_loss, metrics

    # ----------------------------------------------------------------- checkpoint state

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        checkpoint["lit_offpolicy"] = {
            "policy_version": self.policy_version,
            "kl_ctl": self.kl_ctl.state_dict(),
            "reward_moments": self.reward_moments.state_dict(),
            "nonfinite_guard": self.nonfinite_guard.state_dict(),
            "rng": rng_state(),
        }

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        state = checkpoint.get("lit_offpolicy", {})
        self.policy_version = state.get("policy_version", 0)
        if "kl_ctl" in state:
            self.kl_ctl.load_state_dict(state["kl_ctl"])
        if "reward_moments" in state:
            self.reward_moments.load_state_dict(state["reward_moments"])
        if "nonfinite_guard" in state:
            self.nonfinite_guard.load_state_dict(state["nonfinite_guard"])
        self._restored_rng = state.get("rng")

    def on_train_start(self) -> None:
        """Put back the saved RNG states, now that Lightning's data-loader set-up has drawn its seed:
        the first resumed step then starts from the RNG state at which the interrupted run saved."""
        if self._restored_rng is not None:
            set_rng_state(self._restored_rng)
            self._restored_rng = None
