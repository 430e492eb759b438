"""A stand-in for a vLLM server's process, for the tests of servers that come back: ``python
fake_vllm_server.py PORT [MAX_MODEL_LEN]`` answers ``/health``, ``/v1/models``, ``/weight_info`` and
every POST route (a generation answers ``stop``); ``/finish_weight_update`` sets the version that
``/weight_info`` tells. Each route it was asked is appended to ``$FAKE_VLLM_LOG`` (one line each);
it listens after ``$FAKE_VLLM_START_S`` seconds (0: at once).
"""

from __future__ import annotations

import http.server
import json
import os
import sys
import time

PORT = int(sys.argv[1])
MAX_MODEL_LEN = int(sys.argv[2]) if len(sys.argv) > 2 else 64
version = "initial"


class Handler(http.server.BaseHTTPRequestHandler):
    def log_message(self, *args) -> None:
        pass

    def do_GET(self) -> None:
        route = self.path.split("?")[0]
        self._note(route)
        self._answer(
            {"data": [{"max_model_len": MAX_MODEL_LEN}]}
            if route == "/v1/models"
            else {"weight_version": version}
        )

    def do_POST(self) -> None:
        global version
        route = self.path.split("?")[0]
        body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
        self._note(route)
        if route == "/finish_weight_update":
            version = body["weight_version"]
        self._answer({"choices": [{"index": 0, "finish_reason": "stop"}]})

    def _note(self, route: str) -> None:
        if "FAKE_VLLM_LOG" in os.environ:
            with open(os.environ["FAKE_VLLM_LOG"], "a") as log:
                log.write(f"{os.getpid()} {route} {version}\n")

    def _answer(self, answer: dict) -> None:
        body = json.dumps(answer).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


print(f"fake server {os.getpid()} starts", flush=True)
time.sleep(float(os.environ.get("FAKE_VLLM_START_S", "0")))
http.server.ThreadingHTTPServer.allow_reuse_address = True
http.server.ThreadingHTTPServer(("127.0.0.1", PORT), Handler).serve_forever()
