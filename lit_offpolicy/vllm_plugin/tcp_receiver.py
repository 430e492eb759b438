"""The server side of the ``lit_offpolicy_tcp`` weight transfer: a vLLM ``WeightTransferEngine``.

vLLM's own transfer backends (NCCL, CUDA IPC, ...) need GPUs. This one moves the trainer's weights
over one TCP connection per server, so the same HTTP sequence as on a GPU runs on a CPU-only machine
and across nodes: ``/init_weight_transfer_engine`` (the worker connects to the trainer's listener),
``/start_weight_update``, one ``/update_weights`` per bucket (names, dtypes and shapes in the request;
the tensors' bytes on the socket, in that order), ``/finish_weight_update``.

vLLM loads this module in its worker, through the factory entry that ``plugin.register`` adds; the
trainer never imports it (``tcp_sender`` is its side).
"""

from __future__ import annotations

import socket
from dataclasses import dataclass, field

import torch
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

from lit_offpolicy.vllm_plugin.wire import dtype_from_name, receive_exactly


@dataclass
class TcpInitInfo(WeightTransferInitInfo):
    host: str
    """Where the trainer listens."""
    port: int
    token: str
    """Sent first on the connection, so the trainer knows which server it is."""
    timeout_s: float = 600.0
    """Longest wait for one bucket's bytes."""


@dataclass
class TcpUpdateInfo(WeightTransferUpdateInfo):
    names: list[str] = field(default_factory=list)
    dtype_names: list[str] = field(default_factory=list)
    shapes: list[list[int]] = field(default_factory=list)


class TcpWeightTransferEngine(WeightTransferEngine[TcpInitInfo, TcpUpdateInfo]):
    """Receives each bucket's tensors from the trainer's socket and loads them with the model's
    ``load_weights`` (Hugging Face names), inside vLLM's layerwise reload, as its IPC engine does."""

    init_info_cls = TcpInitInfo
    update_info_cls = TcpUpdateInfo
    supports_draft_weight_update = False

    connection: socket.socket | None = None

    def init_transfer_engine(self, init_info: TcpInitInfo) -> None:
        self.shutdown()
        connection = socket.create_connection((init_info.host, init_info.port), timeout=init_info.timeout_s)
        connection.sendall(init_info.token.encode() + b"\n")
        self.connection = connection

    def start_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        initialize_layerwise_reload(self.model)

    def finish_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        finalize_layerwise_reload(self.model, self.model_config)

    def update_weights(self, update_info: dict) -> None:
        # the base class synchronizes an accelerator afterwards; the tensors arrive on the CPU
        self.receive_weights(self.parse_update_info(update_info))

    def receive_weights(self, update_info: TcpUpdateInfo) -> None:
        if self.connection is None:
            raise RuntimeError("no weight transfer connection: call /init_weight_transfer_engine first")
        weights = []
        for name, dtype_name, shape in zip(
            update_info.names, update_info.dtype_names, update_info.shapes, strict=True
        ):
            tensor = torch.empty(shape, dtype=dtype_from_name(dtype_name))
            receive_exactly(self.connection, tensor)
            weights.append((name, tensor.to(self.device)))
        self.model.load_weights(weights)

    def shutdown(self) -> None:
        if self.connection is not None:
            self.connection.close()
            self.connection = None
