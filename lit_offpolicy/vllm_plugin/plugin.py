"""vLLM's plugin entry point (``vllm.general_plugins`` in pyproject.toml): registers the
``lit_offpolicy`` weight transfer backend (TCP or shared memory, ``receiver``) in every vLLM process
of an installed lit-offpolicy."""

import contextlib

BACKEND = "lit_offpolicy"
EARLIER_NAMES = ("lit_offpolicy_tcp",)
"""The backend's name before it had shared memory beside TCP: servers started with it still work."""


def register() -> None:
    """Add the backend to vLLM's transfer engine factory (lazily: its module loads when a server uses it)."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    for name in (BACKEND, *EARLIER_NAMES):
        # registered already where vLLM loads its plugins more than once in a process
        with contextlib.suppress(ValueError):
            WeightTransferEngineFactory.register_engine(
                name, "lit_offpolicy.vllm_plugin.receiver", "HostWeightTransferEngine"
            )
