"""The RL module's option groups, each a frozen dataclass that checks itself when built.

In a config they are nested mappings under ``model.init_args`` (``kl: {use_loss: true, ...}``);
``lit-offpolicy fit --print_config`` and ``--help`` show each field with its docstring below.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

from lit_offpolicy.core.checks import check_choice, check_range
from lit_offpolicy.losses import KL_KINDS

# "full" needs whole vocabulary distributions; the trainer keeps the sampled tokens' log-probs only.
SAMPLED_KL_KINDS = tuple(kind for kind in KL_KINDS if kind != "full") + ("k1", "k2", "k3")
REWARD_NORMS = (None, "batch", "group", "running")
LR_SCHEDULES = ("constant", "linear", "cosine")

G = TypeVar("G")


def as_group(cls: type[G], value: G | Mapping[str, Any]) -> G:
    """``value`` as a ``cls``: a checkpoint's hyper-parameters keep the groups as plain mappings."""
    return cls(**value) if isinstance(value, Mapping) else value


def group_dict(group: Any) -> dict[str, Any]:
    """A group's fields as a plain dict (what a checkpoint keeps)."""
    return dataclasses.asdict(group)


def _non_negative(group: Any, prefix: str, *names: str) -> None:
    for name in names:
        check_range(f"{prefix}.{name}", getattr(group, name), low=0.0)


def _positive_or_none(option: str, value: float | None) -> None:
    if value is not None:
        check_range(option, value, low=0.0, low_inclusive=False)


@dataclass(frozen=True)
class LossOptions:
    """Weights of the loss terms: policy gradient, entropy bonus, critic's value loss."""

    rl_coef: float = 1.0
    """Weight of the policy-gradient loss."""
    entropy_coef: float = 0.0
    """Weight of the entropy bonus (subtracted from the loss); 0 skips computing the entropy."""
    value_coef: float = 0.5
    """Weight of the critic's value loss (with a critic)."""
    value_clip: float | None = None
    """Clip of the new value prediction around the rollout's (PPO's clipped value loss); None: off."""

    def __post_init__(self) -> None:
        _non_negative(self, "loss", "rl_coef", "entropy_coef", "value_coef")
        _positive_or_none("loss.value_clip", self.value_clip)


@dataclass(frozen=True)
class KLOptions:
    """KL(π_θ ‖ π_ref) to the frozen reference: as a loss term (GRPO) and/or a per-token reward penalty
    (PPO, InstructGPT). Either one loads the reference (``reference_path``, else ``model_path``)."""

    use_loss: bool = False
    """Add ``loss_coef`` · KL to the actor's loss."""
    loss_coef: float = 0.001
    """Weight of the KL loss term."""
    loss_type: str = "low_var_kl"
    """Estimator of the KL loss: kl (k1), abs, mse (k2), low_var_kl (k3)."""
    use_in_reward: bool = False
    """Subtract β · KL from every token's reward (π_old is then computed before the update)."""
    penalty: str = "kl"
    """Estimator of the reward penalty (as ``loss_type``)."""
    init_coef: float = 0.2
    """β, or its initial value with ``target``."""
    target: float | None = None
    """Target KL of the adaptive controller (Ziegler et al. 2019); None: β stays fixed."""
    horizon: int = 10000
    """Samples over which the adaptive controller moves β by up to 20 %."""

    def __post_init__(self) -> None:
        check_choice("kl.loss_type", self.loss_type, SAMPLED_KL_KINDS)
        check_choice("kl.penalty", self.penalty, SAMPLED_KL_KINDS)
        _non_negative(self, "kl", "loss_coef", "init_coef")
        _positive_or_none("kl.target", self.target)
        check_range("kl.horizon", self.horizon, low=0, low_inclusive=False)

    @property
    def needs_reference(self) -> bool:
        return self.use_loss or self.use_in_reward


@dataclass(frozen=True)
class DistillOptions:
    """On-policy distillation (``lit_offpolicy.advantages.distillation``): a frozen teacher scores every
    token the student sampled, and each token's advantage becomes
    ``task_coef`` · A_task − ``coef`` · (log π_old − log π_teacher). π_old is then computed before the
    update."""

    teacher_path: str | None = None
    """A local Hugging Face causal-LM directory with the student's tokenizer; None: no distillation."""
    coef: float = 1.0
    """Weight of the per-token reverse KL to the teacher."""
    task_coef: float = 1.0
    """Weight of the task reward's advantage (0: the teacher alone)."""

    def __post_init__(self) -> None:
        _non_negative(self, "distill", "coef", "task_coef")

    @property
    def enabled(self) -> bool:
        return self.teacher_path is not None


@dataclass(frozen=True)
class RewardShaping:
    """Normalization and clipping of the per-sample scores before advantages (ROLL's reward options), and
    DAPO's overlong reward shaping (Yu et al. 2025, arXiv:2503.14476, section 3.4)."""

    norm: str | None = None
    """Where mean and std come from: None (off), "batch", "group" (a prompt's samples), "running"."""
    shift: bool = False
    """Subtract the mean."""
    scale: bool = False
    """Divide by the standard deviation."""
    clip: float | None = None
    """Clamp the (normalized) scores to [−clip, clip]; None: off."""
    overlong_buffer_length: int | None = None
    """DAPO's soft overlong punishment: L_cache, the last tokens before the Rollout callback's
    ``sampling.max_tokens`` (L_max) over which the score is lowered linearly, by
    ((L_max − L_cache) − |y|) / L_cache, to −1 at L_max; added to the score before ``norm``. None: off."""
    overlong_penalty_factor: float = 1.0
    """Scale of the overlong penalty (verl's ``overlong_penalty_factor``)."""
    mask_truncated: bool = False
    """DAPO's overlong filtering: responses the engine cut at ``max_tokens`` (finish reason "length")
    are left out of the policy loss (they still count in their group's statistics)."""

    def __post_init__(self) -> None:
        check_choice("reward_shaping.norm", self.norm, REWARD_NORMS)
        _positive_or_none("reward_shaping.clip", self.clip)
        if self.overlong_buffer_length is not None and (
            isinstance(self.overlong_buffer_length, bool)
            or not isinstance(self.overlong_buffer_length, int)
            or self.overlong_buffer_length < 1
        ):
            raise ValueError(
                f"reward_shaping.overlong_buffer_length={self.overlong_buffer_length!r} is not supported; "
                "allowed values: a whole number of tokens ≥ 1 (below sampling.max_tokens), or None (off)"
            )
        _non_negative(self, "reward_shaping", "overlong_penalty_factor")
        check_choice("reward_shaping.mask_truncated", self.mask_truncated, (True, False))
        if self.shift and self.scale:
            raise ValueError(
                "reward_shaping.shift=True with reward_shaping.scale=True is contradictory; allowed values: "
                "at most one of them (neither means shift and scale)"
            )
        if self.norm is None and (self.shift or self.scale):
            raise ValueError(
                f"reward_shaping.shift={self.shift}, reward_shaping.scale={self.scale} have no effect with "
                "reward_shaping.norm=None; allowed values for norm: 'batch', 'group', 'running'"
            )


@dataclass(frozen=True)
class AdvantageShaping:
    """Whitening and clipping of the advantages, over all ranks' valid tokens."""

    whiten: bool = False
    """Shift and scale the advantages to mean 0 and standard deviation 1."""
    clip: float | None = None
    """Clamp the advantages to [−clip, clip]; None: off."""

    def __post_init__(self) -> None:
        _positive_or_none("advantage_shaping.clip", self.clip)


@dataclass(frozen=True)
class UpdateOptions:
    """How one RL step's samples are turned into optimizer steps (sizes are per rank, in samples)."""

    ppo_epochs: int = 1
    """Passes over the samples."""
    mini_batch_size: int | None = None
    """Samples per optimizer step; None: all of them (one optimizer step per epoch)."""
    micro_batch_size: int | None = None
    """Samples per forward/backward (gradient accumulation, exact); None: the whole mini-batch."""
    max_tokens_per_micro_batch: int | None = None
    """Instead of ``micro_batch_size``: micro-batches of at most this many tokens (prompt + response,
    without padding), samples grouped by length (first-fit decreasing); the accumulation stays exact.
    A sample longer than this is an error. Under data parallelism the ranks' counts are equalized by
    splitting. None: ``micro_batch_size`` decides."""
    sequence_parallel: int = 1
    """Ranks that share each micro-batch, its packed row split along the sequence (Ulysses: attention
    exchanges heads for tokens; ``training.sequence_parallel``): N divides the world size, the ranks
    of a group train on their rollouts together, data parallelism runs over the groups. 1: off."""
    shared_prefix: bool | None = None
    """Each prompt once for the samples of a micro-batch that share it, in every pass
    (``training.shared_prefix``): the same values and gradients, with (n·P + ΣR) / (P + ΣR) times fewer
    tokens for n samples of a P-token prompt. Micro-batches then hold a prompt's samples together, and
    ``max_tokens_per_micro_batch`` counts each prompt once. None: wherever a model's attention runs it
    ("sdpa" on Llama, Mistral, Qwen2 or Qwen3) and without sequence parallelism; True: as None, but a
    model or option that cannot run it stops the run at start-up; False: every sample its own row."""

    @property
    def shares_prefixes(self) -> bool:
        """Whether the passes run shared-prefix rows where a model can (``shared_prefix``)."""
        return self.shared_prefix is not False and self.sequence_parallel == 1

    def __post_init__(self) -> None:
        check_range("update.ppo_epochs", self.ppo_epochs, low=1)
        check_choice("update.shared_prefix", self.shared_prefix, (None, True, False))
        if self.shared_prefix and self.sequence_parallel > 1:
            raise ValueError(
                "update.shared_prefix=true does not run with update.sequence_parallel="
                f"{self.sequence_parallel} (a shared-prefix row is not split across ranks); allowed values: "
                "update.shared_prefix null (the default, left out: off under sequence parallelism) or false"
            )
        check_range("update.sequence_parallel", self.sequence_parallel, low=1)
        for name in ("mini_batch_size", "micro_batch_size", "max_tokens_per_micro_batch"):
            if getattr(self, name) is not None:
                check_range(f"update.{name}", getattr(self, name), low=1)
        if self.micro_batch_size is not None and self.max_tokens_per_micro_batch is not None:
            raise ValueError(
                f"update.micro_batch_size={self.micro_batch_size} and update.max_tokens_per_micro_batch="
                f"{self.max_tokens_per_micro_batch} both cut micro-batches; allowed values: set one of them"
            )


@dataclass(frozen=True)
class OptimOptions:
    """AdamW over the actor (and critic), with a schedule over ``trainer.max_steps`` optimizer steps."""

    lr: float = 1e-5
    """The actor's learning rate."""
    critic_lr: float | None = None
    """The critic's learning rate; None: ``lr``."""
    weight_decay: float = 0.0
    """AdamW's decoupled weight decay."""
    warmup_steps: int = 0
    """Optimizer steps of linear warm-up from lr / warmup_steps."""
    lr_schedule: str = "constant"
    """After the warm-up: "constant", "linear" or "cosine" decay to ``min_lr_ratio`` · lr."""
    min_lr_ratio: float = 0.0
    """The decay's final fraction of lr."""
    max_grad_norm: float | None = 1.0
    """Clip of the global gradient norm; None: no clipping."""

    def __post_init__(self) -> None:
        check_range("optim.lr", self.lr, low=0.0, low_inclusive=False)
        _positive_or_none("optim.critic_lr", self.critic_lr)
        _non_negative(self, "optim", "weight_decay")
        check_range("optim.warmup_steps", self.warmup_steps, low=0)
        check_choice("optim.lr_schedule", self.lr_schedule, LR_SCHEDULES)
        check_range("optim.min_lr_ratio", self.min_lr_ratio, low=0.0, high=1.0)
        _positive_or_none("optim.max_grad_norm", self.max_grad_norm)
