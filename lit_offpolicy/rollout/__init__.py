"""Rollout engines: the ``RolloutEngine`` protocol and its implementations."""

from lit_offpolicy.rollout.engine import Generation, RolloutEngine, SamplingParams, token_log_probs
from lit_offpolicy.rollout.hf_engine import HFEngine
from lit_offpolicy.rollout.vllm_engine import VLLMEngine  # imports vllm only when an engine is built

__all__ = ["Generation", "HFEngine", "RolloutEngine", "SamplingParams", "VLLMEngine", "token_log_probs"]
