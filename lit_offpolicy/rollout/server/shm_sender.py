"""The trainer side of the shared-memory weight transfer (``vllm_plugin.shm_reader`` is the server's).

One ``ShmSegment`` per trainer: a memfd (memory with no name in /dev/shm or on any disk), handed to
the worker of each server on this host over a UNIX socket in the abstract namespace (``SCM_RIGHTS``,
token checked first). A push writes each bucket into it once, whatever the number of local servers,
and each server's ``/update_weights`` names where its tensors lie. Nothing outlives both sides: the
kernel frees the segment with its last holder, and a server's worker drops its hold as soon as the
trainer's end of the socket closes, however the trainer ended.
"""

from __future__ import annotations

import mmap
import os
import secrets
import socket
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor

import torch
from torch import Tensor

from lit_offpolicy.core.messages import one_line
from lit_offpolicy.rollout.server.client import ServerClient, ServerError
from lit_offpolicy.rollout.server.tcp_sender import read_line
from lit_offpolicy.vllm_plugin.wire import dtype_name, tensor_bytes

MEMFD_NAME = "lit-offpolicy-weights"
"""What the segment is called in /proc/PID/fd and /proc/PID/maps (``/memfd:lit-offpolicy-weights``)."""
ALIGN = 64
"""Each tensor starts at a multiple of this many bytes (a cache line)."""
_ACCEPT_POLL_S = 0.2


class ShmSegment:
    """The trainer's shared segment; it grows to the largest bucket and closes with its last sender."""

    def __init__(self) -> None:
        self.fd = os.memfd_create(MEMFD_NAME, os.MFD_CLOEXEC)
        self.mapping: mmap.mmap | None = None
        self.senders: set[ShmWeightSender] = set()
        self._bucket: list[tuple[str, Tensor]] | None = None
        self._info: dict = {}
        self._unread: set[ShmWeightSender] = set()
        self._lock = threading.Lock()

    def stage(self, bucket: list[tuple[str, Tensor]], sender: ShmWeightSender) -> dict:
        """The ``/update_weights`` info of ``bucket``, written into the segment by its first sender;
        the bucket is let go once every sender has it."""
        with self._lock:
            if self._bucket is not bucket:
                self._info = self._write(bucket)
                self._bucket, self._unread = bucket, set(self.senders)
            self._unread.discard(sender)
            if not self._unread:
                self._bucket = None
            return self._info

    def _write(self, bucket: list[tuple[str, Tensor]]) -> dict:
        tensors = [tensor.detach() for _, tensor in bucket]
        offsets, end = [], 0
        for tensor in tensors:
            offsets.append(end)
            end += -(-tensor.numel() * tensor.element_size() // ALIGN) * ALIGN
        if self.mapping is None or len(self.mapping) < end:
            self._grow(end)
        with memoryview(self.mapping) as segment:
            for tensor, offset in zip(tensors, offsets, strict=True):
                if tensor.device.type == "cpu":
                    data = tensor_bytes(tensor)
                    segment[offset : offset + len(data)] = data
                elif tensor.numel():  # from the device straight into the segment: no CPU copy on the way
                    view = torch.frombuffer(
                        self.mapping, dtype=tensor.dtype, count=tensor.numel(), offset=offset
                    )
                    view.copy_(tensor.reshape(-1))
                    del view
        return {
            "names": [name for name, _ in bucket],
            "dtype_names": [dtype_name(tensor.dtype) for tensor in tensors],
            "shapes": [list(tensor.shape) for tensor in tensors],
            "offsets": offsets,
        }

    def _grow(self, size: int) -> None:
        if self.mapping is not None:
            self.mapping.close()
        os.ftruncate(self.fd, size)
        self.mapping = mmap.mmap(self.fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)

    def leave(self, sender: ShmWeightSender) -> None:
        """``sender`` is done with the segment; the last one closes it."""
        with self._lock:
            self.senders.discard(sender)
            self._unread.discard(sender)
            if not self.senders:
                self.close()

    def close(self) -> None:
        """Drop the trainer's mapping and descriptor (once)."""
        if self.mapping is not None:
            self.mapping.close()
            self.mapping = None
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        self._bucket = None


class ShmWeightSender:
    """One server's hold on the trainer's segment, and its ``/update_weights`` per bucket."""

    def __init__(self, client: ServerClient, segment: ShmSegment, timeout_s: float) -> None:
        self.client = client
        self.segment = segment
        name, token = f"lit-offpolicy-weights-{secrets.token_hex(8)}", secrets.token_hex(16)
        init = {"transport": "shm", "socket_name": name, "token": token, "timeout_s": timeout_s}
        with (
            socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as listener,
            ThreadPoolExecutor(1, thread_name_prefix="weight-init") as thread,
        ):
            listener.bind("\0" + name)
            listener.listen(1)
            request = thread.submit(client.post, "/init_weight_transfer_engine", {"init_info": init})
            connection = self._accept(listener, request, timeout_s)
            try:
                if read_line(connection) != token:
                    raise ServerError(f"an unknown process connected for vLLM server {client.url}'s weights")
                socket.send_fds(connection, [b"\0"], [segment.fd])
                request.result()
            except BaseException:
                connection.close()
                raise
        self.connection = connection
        """Kept open: the server's worker lets go of the segment when it closes."""
        segment.senders.add(self)

    def _accept(self, listener: socket.socket, request: Future, timeout_s: float) -> socket.socket:
        """The worker's connection; a ServerError naming ``transfer`` where the server does not come."""
        listener.settimeout(_ACCEPT_POLL_S)
        deadline = time.monotonic() + timeout_s
        why = f"waited {timeout_s:.0f} s"
        while time.monotonic() < deadline:
            try:
                connection, _ = listener.accept()
            except TimeoutError:
                if request.done():
                    error = request.exception()
                    why = one_line(error, limit=300) if error else "it answered without connecting"
                    break
                continue
            connection.settimeout(timeout_s)
            return connection
        raise ServerError(
            f"vLLM server {self.client.url} did not take the trainer's shared memory for the weights "
            f"({why}): is it on this host, in the trainer's network namespace, and started with "
            "lit-offpolicy's --weight-transfer-config? Elsewhere give the engine transfer: tcp"
        )

    def send_bucket(self, bucket: list[tuple[str, Tensor]]) -> None:
        """One ``/update_weights``: the bucket is in the segment (written by the first sender's call)."""
        self.client.post("/update_weights", {"update_info": self.segment.stage(bucket, self)})

    def close(self) -> None:
        self.connection.close()
        self.segment.leave(self)
