"""One vLLM server seen over HTTP: its health, token-in/token-out generation and its RL routes.

The routes are vLLM's (``vllm/entrypoints/rl/online/api_router.py``, mounted with
``VLLM_SERVER_DEV_MODE=1``; ``/inference/v1/generate`` with ``--enable-scale-out``); nothing here is a
server of ours.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from typing import Any

import requests

WAIT_NOTE_EVERY_S = 15.0
"""While a server starts: how often the wait for its ``/health`` is reported."""


class ServerError(RuntimeError):
    """A server answered with an error; the message names its URL. ``server_side``: the server failed
    (an HTTP 5xx, or no answer), not the request (4xx)."""

    def __init__(self, message: str, server_side: bool = True) -> None:
        super().__init__(message)
        self.server_side = server_side


class ServerUnreachable(ServerError):
    """A server did not answer: refused, reset or past the request's time limit."""


class ServerClient:
    """HTTP calls to one server at ``url`` (``http://host:port``), each with a time limit."""

    def __init__(self, url: str, timeout_s: float) -> None:
        self.url = url.rstrip("/")
        self.timeout_s = timeout_s
        self.session = requests.Session()
        # one connection per concurrent request (the engine sends a batch's prompts at once)
        adapter = requests.adapters.HTTPAdapter(pool_connections=1, pool_maxsize=256)
        self.session.mount("http://", adapter)
        self.session.mount("https://", adapter)

    def healthy(self, timeout_s: float = 5.0) -> bool:
        try:
            return self._send("GET", "/health", timeout=timeout_s).status_code == 200
        except requests.RequestException:
            return False

    def wait_healthy(
        self, timeout_s: float, while_starting: Callable[[], None] = lambda: None, report: bool = True
    ) -> bool:
        """Whether ``/health`` answers within ``timeout_s``, asked every half second, with a line on
        stdout (where ``report``) when the wait begins and every ``WAIT_NOTE_EVERY_S``;
        ``while_starting`` runs before each ask (it may raise, e.g. where the server's process has exited)."""
        started = time.monotonic()
        noted = started - WAIT_NOTE_EVERY_S
        while (waited := time.monotonic() - started) < timeout_s:
            while_starting()
            if self.healthy(timeout_s=2.0):
                return True
            if report and time.monotonic() - noted >= WAIT_NOTE_EVERY_S:
                noted = time.monotonic()
                print(
                    f"lit-offpolicy: waiting for rollout server {self.url} to answer /health: "
                    f"{waited:.0f} s of startup_timeout_s={timeout_s:.0f}",
                    flush=True,
                )
            time.sleep(0.5)
        return False

    def get(self, route: str, timeout_s=None) -> Any:
        return self._call("GET", route, timeout_s=timeout_s)

    def post(self, route: str, body: dict | None = None, params: dict | None = None, timeout_s=None) -> Any:
        return self._call("POST", route, body, params, timeout_s)

    def _call(self, method: str, route: str, body=None, params=None, timeout_s=None) -> Any:
        """The answer's JSON; ``ServerUnreachable`` where none came (``_send``), ``ServerError`` for an
        HTTP error."""
        try:
            response = self._send(
                method, route, json=body, params=params, timeout=timeout_s or self.timeout_s
            )
        except requests.RequestException as error:
            raise ServerUnreachable(
                f"vLLM server {self.url} did not answer {route}: {_reason(error)}"
            ) from error
        if response.status_code != 200:
            raise ServerError(
                f"vLLM server {self.url} answered {route} with HTTP {response.status_code}: "
                f"{response.text[:300]}",
                server_side=response.status_code >= 500,
            )
        return response.json()

    def _send(self, method: str, route: str, **request) -> requests.Response:
        """One request. A connection that fails before any answer (refused, reset, closed) is tried
        once more on a new connection: the server closes a kept-alive connection after its idle limit
        (uvicorn's 5 s), and a request sent on it at that moment is dropped unread. A request past its
        time limit is not tried again."""
        try:
            return self.session.request(method, f"{self.url}{route}", **request)
        except requests.ConnectionError as error:
            if isinstance(error, requests.Timeout):
                raise
            with requests.Session() as fresh:
                return fresh.request(method, f"{self.url}{route}", **request)

    def close(self) -> None:
        self.session.close()


def _reason(error: requests.RequestException) -> str:
    """Why a request got no answer, short: the operating system's error where there is one
    (``[Errno 111] Connection refused``), else requests' message without its connection pool's name."""
    text = re.sub(r"HTTPS?ConnectionPool\(host=[^)]*\): ", "", str(error))
    errors = re.findall(r"\[Errno -?\d+\] [^'\")\]]+", text)
    return errors[-1] if errors else text
