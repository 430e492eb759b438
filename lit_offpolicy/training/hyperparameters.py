"""The RL module's hyper-parameters: the record of its constructor's arguments that a checkpoint keeps."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from lit_offpolicy.core.registry import component_config
from lit_offpolicy.training.options import group_dict


def recorded_arguments(given: Mapping[str, Any], module: Any) -> dict[str, Any]:
    """``OffPolicyModule``'s arguments as its checkpoint records them, for ``load_from_checkpoint`` to
    rebuild the same module: ``given`` (the constructor's ``locals()`` on entry, less ``self`` and the
    ``__class__`` cell of ``super()``) in its order, each as passed but the ones ``module`` resolved:
    a component as ``component_config`` (class_path, init_args), an option group as ``group_dict``
    (``lora``'s None stays None)."""
    components = {
        "policy_loss": module.policy_loss,
        "advantage": module.advantage,
        "rollout_correction": module.correction,
    }
    groups = {
        "lora": module.lora,
        "loss": module.loss_options,
        "kl": module.kl,
        "distill": module.distill,
        "reward_shaping": module.reward_shaping,
        "advantage_shaping": module.advantage_shaping,
        "update": module.update_options,
        "optim": module.optim,
    }

    def recorded(name: str, value: Any) -> Any:
        if name in components:
            return component_config(components[name])
        if name in groups:
            return None if groups[name] is None else group_dict(groups[name])
        return value

    return {name: recorded(name, value) for name, value in given.items() if name not in ("self", "__class__")}
