"""Rollout engines: the ``RolloutEngine`` protocol and its implementations."""

from lit_offpolicy.rollout.engine import Generation, RolloutEngine, SamplingParams, token_log_probs
from lit_offpolicy.rollout.hf_engine import HFEngine

__all__ = ["Generation", "HFEngine", "RolloutEngine", "SamplingParams", "token_log_probs"]
