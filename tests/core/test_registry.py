"""The one registry mechanism (``lit_offpolicy.core.registry``) and what it resolves: policy losses,
advantage estimators, rollout engines and rewards by short name, import path, object or config mapping."""

from __future__ import annotations

import pytest

from lit_offpolicy import callbacks
from lit_offpolicy.advantages import ADVANTAGES, GRPO, Reinforce
from lit_offpolicy.core.registry import Registry, component_config
from lit_offpolicy.losses import CISPO, POLICY_LOSSES, PPO, TOPR, PolicyLoss
from lit_offpolicy.rewards import REWARDS
from lit_offpolicy.rollout import ENGINES, HFEngineSpec, VLLMEngineSpec


def test_every_part_has_its_short_names():
    assert list(POLICY_LOSSES) == ["ppo", "vanilla", "tis", "topr", "cispo", "kimi15", "gspo"]
    assert list(ADVANTAGES) == ["gae", "reinforce", "grpo", "rloo", "reinforce++"]
    assert list(ENGINES) == ["hf", "vllm", "vllm_server"]
    assert list(REWARDS) == ["exact", "boxed", "format", "code", "judge", "math_verify", "gsm8k", "model"]


def test_resolve_takes_an_object_a_name_an_import_path_or_a_config_mapping():
    loss = TOPR(positive_weight=0.5)
    assert POLICY_LOSSES.resolve(loss) is loss
    assert type(POLICY_LOSSES.resolve("cispo")) is CISPO
    assert type(POLICY_LOSSES.resolve("lit_offpolicy.losses:PPO")) is PPO
    rebuilt = POLICY_LOSSES.resolve(component_config(loss))
    assert type(rebuilt) is TOPR and rebuilt.positive_weight == 0.5
    assert type(ADVANTAGES.resolve({"class_path": "lit_offpolicy.advantages.Reinforce"})) is Reinforce
    assert isinstance(ENGINES.resolve("hf"), HFEngineSpec)


def test_errors_name_the_option_and_list_the_keys():
    with pytest.raises(ValueError) as raised:
        ADVANTAGES.resolve("gpro")
    assert str(raised.value) == (
        "advantage='gpro' is not supported; allowed values: 'gae', 'reinforce', 'grpo', 'rloo', "
        "'reinforce++', or an import path 'pkg.module:name'"
    )
    with pytest.raises(ValueError, match="engine='sglang' is not supported; allowed values: 'hf', 'vllm'"):
        callbacks.Rollout(engine="sglang")
    with pytest.raises(
        ValueError, match="policy_loss='lit_offpolicy.advantages:GRPO' gives a GRPO, not PolicyLoss"
    ):
        POLICY_LOSSES.resolve("lit_offpolicy.advantages:GRPO")
    with pytest.raises(ValueError, match="advantage='lit_offpolicy.advantages:Nope' cannot be imported"):
        ADVANTAGES.resolve("lit_offpolicy.advantages:Nope")


def test_register_adds_a_name_and_refuses_to_reuse_one():
    registry: Registry = Registry("widget", PolicyLoss)

    @registry.register("mine")
    class Mine(PolicyLoss):
        pass

    assert type(registry.resolve("mine")) is Mine
    with pytest.raises(ValueError, match="widget name 'mine' is already registered"):
        registry.register("mine")(PPO)


def test_component_config_records_the_constructor_arguments():
    assert component_config(GRPO(norm_by_std=False)) == {
        "class_path": "lit_offpolicy.advantages.estimators.GRPO",
        "init_args": {"norm_by_std": False},
    }
    assert component_config(VLLMEngineSpec(max_model_len=64))["init_args"]["max_model_len"] == 64

    class Forgetful(PolicyLoss):
        def __init__(self, scale: float = 1.0) -> None:
            super().__init__()

    with pytest.raises(TypeError, match=r"Forgetful does not keep its arguments \['scale'\]"):
        component_config(Forgetful())


def test_engine_arguments_live_with_the_engine():
    spec = VLLMEngineSpec(max_model_len=64, enable_sleep_mode=True)
    assert callbacks.Rollout(engine=spec).worker.spec is spec
    with pytest.raises(
        ValueError, match=r"colocate=True needs an engine that frees its memory when asleep \('vllm'\)"
    ):
        callbacks.Rollout(engine="hf", colocate=True)
    assert callbacks.Rollout(engine=spec, colocate=True).colocate


def test_the_old_vllm_kwargs_still_work_with_a_deprecation_warning():
    with pytest.warns(DeprecationWarning, match="vllm_kwargs=...\\) is deprecated"):
        rollout = callbacks.Rollout(
            engine="vllm", vllm_kwargs={"max_model_len": 64, "kv_cache_memory_bytes": 2**20}
        )
    assert rollout.worker.spec == VLLMEngineSpec(
        max_model_len=64, engine_kwargs={"kv_cache_memory_bytes": 2**20}
    )
    with pytest.raises(ValueError, match="vllm_kwargs is given for engine=HFEngineSpec"):
        callbacks.Rollout(engine="hf", vllm_kwargs={"max_model_len": 64})
