"""lit-offpolicy: Lightning-native off-policy reinforcement learning for language models."""

from lit_offpolicy import _moved
from lit_offpolicy.module import OffPolicyModule
from lit_offpolicy.sft import SFTModule

_moved.install()

__version__ = "0.1.0"

__all__ = ["OffPolicyModule", "SFTModule", "__version__"]
