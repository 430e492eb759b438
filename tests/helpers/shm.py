"""Who holds the shared-memory weight segment (``shm_sender.MEMFD_NAME``): by descriptor or by mapping."""

from __future__ import annotations

import os

from lit_offpolicy.rollout.server.shm_sender import MEMFD_NAME


def segment_holders(pids) -> dict[int, list[str]]:
    """The processes of ``pids`` that hold a segment, with what they hold (fd links, mapped lines)."""
    held = {}
    for pid in pids:
        found = []
        try:
            for fd in os.listdir(f"/proc/{pid}/fd"):
                try:
                    target = os.readlink(f"/proc/{pid}/fd/{fd}")
                except OSError:
                    continue
                if MEMFD_NAME in target:
                    found.append(f"fd {fd}: {target}")
            with open(f"/proc/{pid}/maps") as maps:
                found += [line.strip() for line in maps if MEMFD_NAME in line]
        except OSError:  # gone meanwhile
            continue
        if found:
            held[pid] = found
    return held


def segment_holders_after(pids, timeout_s: float = 10.0) -> dict[int, list[str]]:
    """``segment_holders`` once none is left or ``timeout_s`` has passed: a server's worker lets go of
    the segment on its own thread, as soon as it sees the trainer's end of its socket close."""
    import time

    pids = list(pids)
    deadline = time.monotonic() + timeout_s
    while (held := segment_holders(pids)) and time.monotonic() < deadline:
        time.sleep(0.02)
    return held


class ShmServer:
    """A real HTTP server on loopback that plays a vLLM server's side of the shared-memory transfer with
    the plugin's own ``ShmReader``: it takes the segment at ``/init_weight_transfer_engine`` and copies
    each ``/update_weights`` bucket's views of it into ``received``. ``hang_at``: the bucket (from 1) whose
    request, once copied, it never answers (a server stuck mid-push), calling ``on_hang`` first."""

    def __init__(self, hang_at: int = 0, on_hang=None) -> None:
        import http.server
        import json
        import time

        import torch

        from helpers.loopback import serve
        from lit_offpolicy.vllm_plugin.shm_reader import ShmReader

        self.reader: ShmReader | None = None
        self.received: dict[str, torch.Tensor] = {}
        self.buckets = 0
        owner = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:
                pass

            def do_GET(self) -> None:
                self._answer()

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                if self.path == "/init_weight_transfer_engine":
                    init = body["init_info"]
                    owner.reader = ShmReader(init["socket_name"], init["token"], init["timeout_s"])
                elif self.path == "/update_weights":
                    info = body["update_info"]
                    with owner.reader.views(info["dtype_names"], info["shapes"], info["offsets"]) as tensors:
                        for name, tensor in zip(info["names"], tensors, strict=True):
                            owner.received[name] = tensor.clone()
                        del tensor
                    owner.buckets += 1
                    if owner.buckets == hang_at:
                        on_hang()
                        time.sleep(600)
                self._answer()

            def _answer(self) -> None:
                self.send_response(200)
                self.send_header("Content-Length", "2")
                self.end_headers()
                self.wfile.write(b"{}")

        self.httpd, self.url = serve(Handler)

    def close(self) -> None:
        from helpers.loopback import stop

        stop(self.httpd)
        if self.reader is not None:
            self.reader.close()
