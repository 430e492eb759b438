"""The server's side of the shared-memory weight transfer: the trainer's segment, mapped.

The trainer holds one memfd (an anonymous file in memory: no name in /dev/shm or anywhere) for all
the servers on its host, and hands it over a UNIX socket in the abstract namespace (``SCM_RIGHTS``)
to each server's worker that connects and sends the right token. The worker keeps that connection
open: when the trainer's end closes (it exits, or dies mid-push), a watcher thread drops the worker's
mapping and descriptor at once, so the kernel frees the segment with the last holder.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import socket
import threading

import torch

from lit_offpolicy.vllm_plugin.wire import writable_bytes


class ShmReader:
    """A server worker's view of the trainer's segment: ``fill`` copies a tensor's bytes out of it."""

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

    def fill(self, tensor: torch.Tensor, offset: int) -> None:
        """Copy ``tensor``'s size in bytes from ``offset`` of the segment into the contiguous ``tensor``."""
        target = writable_bytes(tensor)
        end = offset + len(target)
        with self.lock:
            if self.fd is None:
                raise ConnectionError("the trainer left during the weight transfer: its segment is closed")
            if self.mapping is None or len(self.mapping) < end:  # the trainer grew it for a larger bucket
                self._map(os.fstat(self.fd).st_size)
            with memoryview(self.mapping) as segment:
                target[:] = segment[offset:end]

    def _map(self, size: int) -> None:
        if self.mapping is not None:
            self.mapping.close()
        self.mapping = mmap.mmap(self.fd, size, mmap.MAP_SHARED, mmap.PROT_READ)

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
