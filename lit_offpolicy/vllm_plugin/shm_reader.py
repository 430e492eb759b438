"""The server's side of the shared-memory weight transfer: the trainer's segment, mapped.

The trainer holds one memfd (an anonymous file in memory: no name in /dev/shm or anywhere) for all
the servers on its host, and hands it over a UNIX socket in the abstract namespace (``SCM_RIGHTS``)
to each server's worker that connects and sends the right token. The worker keeps that connection
open: when the trainer's end closes (it exits, or dies mid-push), a watcher thread drops the worker's
mapping and descriptor at once, so the kernel frees the segment with the last holder.
"""

from __future__ import annotations

import contextlib
import math
import mmap
import os
import socket
import threading

import torch

from lit_offpolicy.vllm_plugin.wire import dtype_from_name


class ShmReader:
    """A server worker's view of the trainer's segment: ``views`` are a bucket's tensors in it."""

    def __init__(self, socket_name: str, token: str, timeout_s: float) -> None:
        connection = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            connection.settimeout(timeout_s)
            connection.connect("\0" + socket_name)
            connection.sendall(token.encode() + b"\n")
            _, fds, _, _ = socket.recv_fds(connection, 1, 1)
        except BaseException:
            connection.close()
            raise
        if not fds:
            connection.close()
            raise ConnectionError("the trainer closed its shared-memory socket without handing the segment")
        self.fd: int | None = fds[0]
        self.connection = connection
        self.mapping: mmap.mmap | None = None
        self.lock = threading.Lock()
        threading.Thread(target=self._close_when_trainer_leaves, name="shm-watch", daemon=True).start()

    @contextlib.contextmanager
    def views(self, dtype_names: list[str], shapes: list[list[int]], offsets: list[int]):
        """A bucket's tensors as views of the segment (no copy), for the block only: the segment stays
        mapped meanwhile, and the caller must let go of every view (and every view of a view) by its
        end, where one still held is a RuntimeError: the trainer writes the next bucket over them."""
        dtypes = [dtype_from_name(name) for name in dtype_names]
        sizes = [math.prod(shape) * dtype.itemsize for shape, dtype in zip(shapes, dtypes, strict=True)]
        with self.lock:
            if self.fd is None:
                raise ConnectionError("the trainer left during the weight transfer: its segment is closed")
            end = max((offset + size for offset, size in zip(offsets, sizes, strict=True)), default=0)
            if self.mapping is None or len(self.mapping) < end:  # the trainer grew it for a larger bucket
                self._map(os.fstat(self.fd).st_size)
            tensors = [
                torch.frombuffer(self.mapping, dtype=dtype, count=size // dtype.itemsize, offset=offset).view(
                    shape
                )
                for dtype, shape, size, offset in zip(dtypes, shapes, sizes, offsets, strict=True)
            ]
            storages = [tensor.untyped_storage() for tensor in tensors]
            yield tensors
            tensors.clear()
            held = sum(torch._C._storage_Use_Count(storage._cdata) > 1 for storage in storages)
            if held:
                raise RuntimeError(
                    f"{held} tensor(s) of the shared weight segment are still held after their bucket was "
                    "loaded: the next bucket would overwrite them"
                )

    def holds(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor``'s memory lies in the mapped segment."""
        if self.mapping is None:
            return False
        start = torch.frombuffer(self.mapping, dtype=torch.uint8, count=1).data_ptr()
        return start <= tensor.data_ptr() < start + len(self.mapping)

    def _map(self, size: int) -> None:
        if self.mapping is not None:
            self.mapping.close()
        self.mapping = mmap.mmap(self.fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)

    def _close_when_trainer_leaves(self) -> None:
        try:
            self.connection.settimeout(None)
            self.connection.recv(1)  # the trainer sends nothing more: this returns when its end closes
        except OSError:
            pass
        self.close()

    def close(self) -> None:
        """Drop the mapping and the descriptor (once; safe from any thread)."""
        with self.lock:
            if self.mapping is not None:
                self.mapping.close()
                self.mapping = None
            if self.fd is not None:
                os.close(self.fd)
                self.fd = None
        with contextlib.suppress(OSError):
            self.connection.shutdown(socket.SHUT_RDWR)  # wakes the watcher's recv
        self.connection.close()
