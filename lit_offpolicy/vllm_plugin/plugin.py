"""vLLM's plugin entry point (``vllm.general_plugins`` in pyproject.toml): registers the
``lit_offpolicy_tcp`` weight transfer backend in every vLLM process of an installed lit-offpolicy."""

import contextlib

BACKEND = "lit_offpolicy_tcp"


def register() -> None:
    """Add the backend to vLLM's transfer engine factory (lazily: its module loads when a server uses it)."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    # registered already where vLLM loads its plugins more than once in a process
    with contextlib.suppress(ValueError):
        WeightTransferEngineFactory.register_engine(
            BACKEND, "lit_offpolicy.vllm_plugin.tcp_receiver", "TcpWeightTransferEngine"
        )
