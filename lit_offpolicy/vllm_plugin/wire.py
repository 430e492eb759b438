"""The bytes of the weight transfer: tensors as raw contiguous bytes, in order on a TCP connection, at
aligned offsets in a shared-memory segment."""

from __future__ import annotations

import socket

import torch

_DTYPES = {name: getattr(torch, name) for name in ("float32", "float16", "bfloat16", "float64")}


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.float32`` -> "float32", for the update request."""
    name = str(dtype).removeprefix("torch.")
    if name not in _DTYPES:
        raise ValueError(f"weights of dtype {dtype} cannot be sent; allowed: {sorted(_DTYPES)}")
    return name


def dtype_from_name(name: str) -> torch.dtype:
    if name not in _DTYPES:
        raise ValueError(f"unknown weight dtype {name!r}; allowed: {sorted(_DTYPES)}")
    return _DTYPES[name]


def tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """A CPU tensor's bytes (a view, no copy, when it is contiguous)."""
    flat = tensor.detach().reshape(-1).contiguous()
    return memoryview(flat.view(torch.uint8).numpy()).cast("B")


def writable_bytes(tensor: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU ``tensor``, to fill it."""
    return memoryview(tensor.view(-1).view(torch.uint8).numpy()).cast("B")


def receive_exactly(connection: socket.socket, tensor: torch.Tensor) -> None:
    """Fill the contiguous CPU ``tensor`` with its size in bytes read from ``connection``."""
    view = writable_bytes(tensor)
    received = 0
    while received < len(view):
        count = connection.recv_into(view[received:])
        if count == 0:
            raise ConnectionError(
                f"the trainer closed the weight transfer after {received} of {len(view)} bytes"
            )
        received += count
