"""lit-offpolicy: Lightning-native off-policy reinforcement learning for language models."""

__version__ = "0.1.0"
