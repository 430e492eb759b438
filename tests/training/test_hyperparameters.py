"""The hyper-parameters ``OffPolicyModule`` records for ``load_from_checkpoint``: every constructor argument
in the signature's order, a component as its class_path/init_args, an option group as a plain mapping
(a partial mapping filled with the group's defaults), everything else as passed."""

from __future__ import annotations

import dataclasses

import pytest

from lit_offpolicy import OffPolicyModule
from lit_offpolicy.advantages import GRPO, Reinforce
from lit_offpolicy.correction import RolloutCorrection
from lit_offpolicy.losses import PPO, TOPR
from lit_offpolicy.models.lora import LoraOptions
from lit_offpolicy.training.options import (
    AdvantageShaping,
    DistillOptions,
    KLOptions,
    LossOptions,
    OptimOptions,
    RewardShaping,
    UpdateOptions,
)


def config(component) -> dict:
    """A component as a checkpoint keeps it, written out here rather than through ``component_config``."""
    cls = type(component)
    init_args = dataclasses.asdict(component) if dataclasses.is_dataclass(component) else vars(component)
    return {"class_path": f"{cls.__module__}.{cls.__qualname__}", "init_args": init_args}


def test_a_module_with_other_components_and_groups_records_them_resolved(tiny_model_dir):
    topr = TOPR(positive_weight=0.7, negative_weight=0.3, loss_agg_mode="seq-mean-token-sum")
    lora = LoraOptions(r=2, alpha=6.0, target_modules=["q_proj", "v_proj"])
    module = OffPolicyModule(
        tiny_model_dir,
        policy_loss=topr,
        advantage=Reinforce(gamma=0.9),
        rollout_correction="seq_is_rs",
        reference_path=tiny_model_dir,
        dtype="float32",
        gradient_checkpointing=True,
        logprob_chunk_size=None,
        padding_free=True,
        attn_implementation="eager",
        lora=lora,
        loss={"entropy_coef": 0.01},  # a mapping, as a checkpoint gives it back: recorded with the defaults
        kl=KLOptions(use_loss=True, loss_coef=0.05),
        reward_shaping=RewardShaping(norm="batch", shift=True),
        advantage_shaping={"whiten": True},
        update=UpdateOptions(ppo_epochs=2, micro_batch_size=2),
        optim=OptimOptions(lr=1e-3, warmup_steps=2, lr_schedule="cosine"),
        max_consecutive_nonfinite=3,
    )
    expected = {
        "model_path": tiny_model_dir,
        "policy_loss": config(topr),
        "advantage": config(Reinforce(gamma=0.9)),
        "rollout_correction": config(RolloutCorrection.seq_is_rs()),
        "critic_path": None,
        "reference_path": tiny_model_dir,
        "dtype": "float32",
        "gradient_checkpointing": True,
        "logprob_chunk_size": None,
        "padding_free": True,
        "compile": False,
        "attn_implementation": "eager",
        "lora": {"r": 2, "alpha": 6.0, "dropout": 0.0, "target_modules": ["q_proj", "v_proj"]},
        "loss": dataclasses.asdict(LossOptions(entropy_coef=0.01)),
        "kl": dataclasses.asdict(KLOptions(use_loss=True, loss_coef=0.05)),
        "distill": dataclasses.asdict(DistillOptions()),
        "reward_shaping": dataclasses.asdict(RewardShaping(norm="batch", shift=True)),
        "advantage_shaping": {"whiten": True, "clip": None},
        "update": dataclasses.asdict(UpdateOptions(ppo_epochs=2, micro_batch_size=2)),
        "optim": dataclasses.asdict(OptimOptions(lr=1e-3, warmup_steps=2, lr_schedule="cosine")),
        "max_consecutive_nonfinite": 3,
    }
    assert dict(module.hparams) == expected
    assert list(module.hparams) == list(expected)  # the signature's order
    # what load_from_checkpoint does with them: the same module, recording the same
    rebuilt = OffPolicyModule(**module.hparams)
    assert dict(rebuilt.hparams) == expected
    assert vars(rebuilt.policy_loss) == vars(topr) and rebuilt.lora == lora


def test_a_module_with_the_defaults_records_the_default_components(tiny_model_dir):
    module = OffPolicyModule(model_path=tiny_model_dir)
    groups = {
        "loss": LossOptions(),
        "kl": KLOptions(),
        "distill": DistillOptions(),
        "reward_shaping": RewardShaping(),
        "advantage_shaping": AdvantageShaping(),
        "update": UpdateOptions(),
        "optim": OptimOptions(),
    }
    assert dict(module.hparams) == {
        "model_path": tiny_model_dir,
        "policy_loss": config(PPO()),
        "advantage": config(GRPO()),
        "rollout_correction": config(RolloutCorrection.disabled()),
        "critic_path": None,
        "reference_path": None,
        "dtype": "float32",
        "gradient_checkpointing": False,
        "logprob_chunk_size": module.logprob_chunk_size,
        "padding_free": False,
        "compile": False,
        "attn_implementation": None,
        "lora": None,
        **{name: dataclasses.asdict(group) for name, group in groups.items()},
        "max_consecutive_nonfinite": 5,
    }


@pytest.mark.parametrize("lora", [None, {"r": 4}])
def test_lora_is_recorded_as_a_mapping_or_none(tiny_model_dir, lora):
    module = OffPolicyModule(model_path=tiny_model_dir, lora=lora)
    assert module.hparams["lora"] == (None if lora is None else dataclasses.asdict(LoraOptions(r=4)))
