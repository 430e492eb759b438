"""Policy losses, loss aggregation, KL estimators and controllers, the value loss and the entropy."""

from lit_offpolicy.losses.aggregation import LOSS_AGG_MODES, aggregate, micro_batch_weight
from lit_offpolicy.losses.base import POLICY_LOSSES, PolicyInputs, PolicyLoss, PolicyLossOutput
from lit_offpolicy.losses.entropy import entropy_from_logits
from lit_offpolicy.losses.kl import (
    KL_KINDS,
    AdaptiveKLController,
    FixedKLController,
    kl_controller,
    kl_penalty,
)
from lit_offpolicy.losses.policy_losses import CISPO, GSPO, PPO, TIS, TOPR, Kimi15, Vanilla
from lit_offpolicy.losses.value import value_loss

__all__ = [
    "CISPO",
    "GSPO",
    "KL_KINDS",
    "LOSS_AGG_MODES",
    "POLICY_LOSSES",
    "PPO",
    "TIS",
    "TOPR",
    "AdaptiveKLController",
    "FixedKLController",
    "Kimi15",
    "PolicyInputs",
    "PolicyLoss",
    "PolicyLossOutput",
    "Vanilla",
    "aggregate",
    "entropy_from_logits",
    "kl_controller",
    "kl_penalty",
    "micro_batch_weight",
    "value_loss",
]
