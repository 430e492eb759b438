"""lit-offpolicy: Lightning-native off-policy reinforcement learning for language models.

``OffPolicyModule`` and ``SFTModule`` load on first use: a process that needs one small module, such
as vLLM's server processes loading the weight-transfer plugin, does not import Lightning.
"""

from lit_offpolicy import _moved
from lit_offpolicy.core.lazy import lazy_exports

_moved.install()

__version__ = "0.1.0"

__all__ = ["OffPolicyModule", "SFTModule", "__version__"]

__getattr__ = lazy_exports(
    __name__, {"OffPolicyModule": "lit_offpolicy.module", "SFTModule": "lit_offpolicy.sft"}, globals()
)
