"""Rollout engines: the ``RolloutEngine`` protocol, the ``ENGINES`` registry of engine specs, and
their implementations (HF ``generate``, in-process vLLM, vLLM servers outside the trainer)."""

from lit_offpolicy.core.generation import Generation  # what an engine returns; re-exported for plugins
from lit_offpolicy.core.logprobs import token_log_probs  # the convention an engine's log-probs follow
from lit_offpolicy.rollout.engine import (
    ENGINES,
    EngineContext,
    EngineLimitError,
    EngineRefused,
    EngineSpec,
    RolloutEngine,
    SamplingParams,
)
from lit_offpolicy.rollout.hf_engine import HFEngine, HFEngineSpec
from lit_offpolicy.rollout.server import ServerError, ServersLostError, VLLMServerEngine, VLLMServerSpec
from lit_offpolicy.rollout.vllm_engine import VLLMEngine, VLLMEngineSpec  # vllm is imported when built

__all__ = [
    "ENGINES",
    "EngineContext",
    "EngineLimitError",
    "EngineRefused",
    "EngineSpec",
    "Generation",
    "HFEngine",
    "HFEngineSpec",
    "RolloutEngine",
    "SamplingParams",
    "ServerError",
    "ServersLostError",
    "VLLMEngine",
    "VLLMEngineSpec",
    "VLLMServerEngine",
    "VLLMServerSpec",
    "token_log_probs",
]
