"""The trainer side of the weight transfer over TCP (``vllm_plugin.receiver`` is the server's).

Per server: a listening socket on the trainer, ``/init_weight_transfer_engine`` with its address
and a token (the server's worker connects back and sends the token); then, within each push that the
engine drives (``VLLMServerEngine.load_weights``), one ``/update_weights`` per bucket while the
bucket's bytes go down the socket.
"""

from __future__ import annotations

import secrets
import socket
import threading

from torch import Tensor

from lit_offpolicy.rollout.server.client import ServerClient, ServerError
from lit_offpolicy.vllm_plugin.plugin import BACKEND
from lit_offpolicy.vllm_plugin.wire import dtype_name, tensor_bytes


class TcpWeightSender:
    """The connection to one server's weight transfer engine."""

    def __init__(self, client: ServerClient, host: str, timeout_s: float) -> None:
        self.client = client
        token = secrets.token_hex(16)
        with socket.create_server((host, 0)) as listener:
            listener.settimeout(timeout_s)
            port = listener.getsockname()[1]
            init = {"transport": "tcp", "host": host, "port": port, "token": token, "timeout_s": timeout_s}
            client.post("/init_weight_transfer_engine", {"init_info": init})
            try:
                connection, _ = listener.accept()
            except TimeoutError as error:
                raise ServerError(
                    f"vLLM server {client.url} did not connect back to {host}:{port} for the weights "
                    f"within {timeout_s:.0f} s: is it started with --weight-transfer-config "
                    f'\'{{"backend": "{BACKEND}"}}\' and lit-offpolicy installed beside it?'
                ) from error
        connection.settimeout(timeout_s)
        if read_line(connection) != token:
            connection.close()
            raise ServerError(f"an unknown process connected for vLLM server {client.url}'s weights")
        self.connection = connection

    def send_bucket(self, bucket: list[tuple[str, Tensor]]) -> None:
        """One ``/update_weights``: the bucket's metadata by HTTP, its bytes on the socket meanwhile."""
        cpu = [(name, tensor.detach().cpu()) for name, tensor in bucket]
        info = {
            "names": [name for name, _ in cpu],
            "dtype_names": [dtype_name(tensor.dtype) for _, tensor in cpu],
            "shapes": [list(tensor.shape) for _, tensor in cpu],
        }
        failure: list[BaseException] = []

        def request() -> None:
            try:
                self.client.post("/update_weights", {"update_info": info})
            except BaseException as error:  # noqa: BLE001 - re-raised in the caller's thread
                failure.append(error)

        thread = threading.Thread(target=request, name="weight-update-request", daemon=True)
        thread.start()
        try:
            for _, tensor in cpu:
                self.connection.sendall(tensor_bytes(tensor))
        except OSError as error:
            thread.join(timeout=self.client.timeout_s)
            raise ServerError(f"sending weights to vLLM server {self.client.url} failed: {error}") from error
        thread.join()
        if failure:
            raise failure[0]

    def close(self) -> None:
        self.connection.close()


def read_line(connection: socket.socket) -> str:
    """The first line a server's worker sends on its connection: its token."""
    data = b""
    while not data.endswith(b"\n") and len(data) < 256:
        chunk = connection.recv(1)
        if not chunk:
            break
        data += chunk
    return data.decode(errors="replace").strip()
