"""The server side of the ``lit_offpolicy`` weight transfer: a vLLM ``WeightTransferEngine``.

vLLM's own transfer backends (NCCL, CUDA IPC, ...) need GPUs. This one moves the trainer's weights
through host memory, so the same HTTP sequence as on a GPU runs on a CPU-only machine and across
nodes: ``/init_weight_transfer_engine`` (the worker reaches the trainer: see the transports below),
``/start_weight_update``, one ``/update_weights`` per bucket (names, dtypes and shapes in the request;
the tensors' bytes beside it), ``/finish_weight_update``.

Two transports, chosen by the trainer in the init request (``transport``):

- ``tcp``: the worker connects to the trainer's listener; each bucket's bytes come down that
  connection, in order. Any host.
- ``shm``: the worker receives the trainer's shared-memory segment (``shm_reader``); each bucket is
  in it, at the offsets the request gives. The trainer's host only: it writes each bucket once for
  all its servers there.

vLLM loads this module in its worker, through the factory entry that ``plugin.register`` adds; the
trainer never imports it (``tcp_sender`` and ``shm_sender`` are its side).
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

from lit_offpolicy.vllm_plugin.shm_reader import ShmReader
from lit_offpolicy.vllm_plugin.wire import dtype_from_name, receive_exactly

TRANSPORTS = ("tcp", "shm")


@dataclass
class HostInitInfo(WeightTransferInitInfo):
    token: str
    """Sent first on the connection, so the trainer knows which server it is."""
    transport: str = "tcp"
    host: str = ""
    """tcp: where the trainer listens."""
    port: int = 0
    socket_name: str = ""
    """shm: the trainer's UNIX socket, in the abstract namespace (no file)."""
    timeout_s: float = 600.0
    """Longest wait for one bucket's bytes."""


@dataclass
class HostUpdateInfo(WeightTransferUpdateInfo):
    names: list[str] = field(default_factory=list)
    dtype_names: list[str] = field(default_factory=list)
    shapes: list[list[int]] = field(default_factory=list)
    offsets: list[int] = field(default_factory=list)
    """shm: where each tensor's bytes start in the segment (tcp: empty, the bytes come in order)."""


class TcpReader:
    """The worker's connection to the trainer's listener; ``fill`` reads the next tensor's bytes into
    memory of the tensor's own."""

    def __init__(self, host: str, port: int, token: str, timeout_s: float) -> None:
        self.connection = socket.create_connection((host, port), timeout=timeout_s)
        self.connection.sendall(token.encode() + b"\n")

    def fill(self, tensor: torch.Tensor) -> None:
        receive_exactly(self.connection, tensor)

    def close(self) -> None:
        self.connection.close()


class HostWeightTransferEngine(WeightTransferEngine[HostInitInfo, HostUpdateInfo]):
    """Reads each bucket's tensors (``TcpReader`` or ``ShmReader``) and loads them with the model's
    ``load_weights`` (Hugging Face names), inside vLLM's layerwise reload, as its IPC engine does.

    Shared memory is loaded from where it lies, with no copy; but the layerwise reload keeps the
    tensors of a layer that is not complete yet (one split between buckets, a padded embedding until
    the end) past the bucket, which the next one overwrites: those are copied out at once
    (``own_pending_weights``), and a view left over is an error, never a silent overwrite."""

    init_info_cls = HostInitInfo
    update_info_cls = HostUpdateInfo
    supports_draft_weight_update = False

    reader: TcpReader | ShmReader | None = None

    def init_transfer_engine(self, init_info: HostInitInfo) -> None:
        self.shutdown()
        if init_info.transport == "shm":
            self.reader = ShmReader(init_info.socket_name, init_info.token, init_info.timeout_s)
        elif init_info.transport == "tcp":
            self.reader = TcpReader(init_info.host, init_info.port, init_info.token, init_info.timeout_s)
        else:
            raise ValueError(f"transport={init_info.transport!r} is not supported; allowed: {TRANSPORTS}")

    def start_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        initialize_layerwise_reload(self.model)

    def finish_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        finalize_layerwise_reload(self.model, self.model_config)

    def update_weights(self, update_info: dict) -> None:
        # the base class synchronizes an accelerator afterwards; the tensors arrive on the CPU
        self.receive_weights(self.parse_update_info(update_info))

    def receive_weights(self, update_info: HostUpdateInfo) -> None:
        if self.reader is None:
            raise RuntimeError("no weight transfer connection: call /init_weight_transfer_engine first")
        info = update_info
        if isinstance(self.reader, ShmReader):
            with self.reader.views(info.dtype_names, info.shapes, info.offsets) as tensors:
                try:
                    self.model.load_weights(
                        [(n, t.to(self.device)) for n, t in zip(info.names, tensors, strict=True)]
                    )
                finally:
                    own_pending_weights(self.reader.holds)
            return
        weights = []
        for name, dtype_name, shape in zip(info.names, info.dtype_names, info.shapes, strict=True):
            tensor = torch.empty(shape, dtype=dtype_from_name(dtype_name))
            self.reader.fill(tensor)
            weights.append((name, tensor.to(self.device)))
        self.model.load_weights(weights)

    def shutdown(self) -> None:
        if self.reader is not None:
            self.reader.close()
            self.reader = None


def own_pending_weights(in_segment) -> None:
    """Give the tensors that vLLM's layerwise reload keeps for layers not yet complete (its
    ``loaded_weights``) memory of their own where they lie in the shared segment (``in_segment``)."""
    from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO

    for info in list(LAYERWISE_INFO.values()):
        for _, bound in info.loaded_weights:
            for key, value in bound.arguments.items():
                if isinstance(value, torch.Tensor) and in_segment(value):
                    bound.arguments[key] = value.clone()
