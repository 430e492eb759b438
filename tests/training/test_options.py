"""The option groups check themselves when built, naming the option by its dotted path, and the
module takes them as objects or as the plain mappings a checkpoint keeps."""

from __future__ import annotations

import pytest

from lit_offpolicy import callbacks
from lit_offpolicy.rollout import SamplingParams
from lit_offpolicy.rollout.evaluation import ValidationConfig
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


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (lambda: LossOptions(entropy_coef=-0.1), "loss.entropy_coef=-0.1 is out of range"),
        (lambda: LossOptions(value_clip=0.0), "loss.value_clip=0.0 is out of range"),
        (lambda: KLOptions(loss_type="full"), "kl.loss_type='full' is not supported"),
        (lambda: KLOptions(target=-1.0), "kl.target=-1.0 is out of range"),
        (lambda: KLOptions(horizon=0), "kl.horizon=0 is out of range"),
        (lambda: RewardShaping(norm="global"), "reward_shaping.norm='global' is not supported"),
        (lambda: RewardShaping(norm="batch", shift=True, scale=True), "is contradictory"),
        (lambda: RewardShaping(scale=True), "have no effect with reward_shaping.norm=None"),
        (lambda: AdvantageShaping(clip=-2.0), "advantage_shaping.clip=-2.0 is out of range"),
        (lambda: UpdateOptions(ppo_epochs=0), "update.ppo_epochs=0 is out of range"),
        (lambda: UpdateOptions(micro_batch_size=0), "update.micro_batch_size=0 is out of range"),
        (lambda: OptimOptions(lr=0.0), "optim.lr=0.0 is out of range"),
        (lambda: OptimOptions(lr_schedule="step"), "optim.lr_schedule='step' is not supported"),
        (lambda: OptimOptions(min_lr_ratio=1.5), "optim.min_lr_ratio=1.5 is out of range"),
        (lambda: ValidationConfig(pass_k=0), "validation.pass_k=0 is out of range"),
    ],
)
def test_a_group_refuses_a_bad_field_by_its_dotted_name(build, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        build()


def test_a_group_round_trips_through_a_mapping():
    kl = KLOptions(use_in_reward=True, target=0.05)
    assert as_group(KLOptions, group_dict(kl)) == kl
    assert as_group(KLOptions, kl) is kl


def test_validation_must_follow_the_weight_pushes():
    with pytest.raises(ValueError, match="validation.every_n_steps=3 must be a multiple of sync_every=2"):
        callbacks.Rollout(validation=ValidationConfig(every_n_steps=3), sync_every=2)
    rollout = callbacks.Rollout(sampling=SamplingParams(n=2), validation=ValidationConfig(every_n_steps=None))
    assert rollout.worker.validation.every == 0
