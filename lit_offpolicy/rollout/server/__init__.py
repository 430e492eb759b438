"""Rollouts on vLLM's own servers outside the trainer: launching them under a watchdog, the pool that
spreads requests and survives a lost server, and the CPU weight transfer through vLLM's RL routes."""

from lit_offpolicy.rollout.server.client import ServerError
from lit_offpolicy.rollout.server.engine import VLLMServerEngine, VLLMServerSpec
from lit_offpolicy.rollout.server.pool import RequestFailed, ServersLostError

__all__ = ["RequestFailed", "ServerError", "ServersLostError", "VLLMServerEngine", "VLLMServerSpec"]
