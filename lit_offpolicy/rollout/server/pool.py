"""Requests over a pool of vLLM servers: least outstanding work first, a prompt's group on one server,
a lost server's requests re-sent to the others.

A server is lost when it does not answer (refused, reset, past ``request_timeout_s``), or when it
fails a request (an HTTP 5xx, a response that ends with ``abort``: its engine core died under a live
API server) and then fails its ``/health`` too. Once the pool is in use, a monitor asks every live
server's ``/health`` every ``HEALTH_EVERY_S``: a server that stops answering (an API server whose
engine core died may hold its connections open and answer nothing) is lost within seconds, not at
its calls' time limit, and the calls waiting on it are re-sent or skipped. A request that fails on a
server that is still healthy is re-sent at most ``FAILED_TRIES`` times in all, then ends the run
with its reasons.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from lit_offpolicy.core.messages import one_line
from lit_offpolicy.rollout.server.client import ServerClient, ServerError, ServerUnreachable
from lit_offpolicy.rollout.server.process import LaunchedServer
from lit_offpolicy.rollout.server.tcp_sender import TcpWeightSender

HEALTH_EVERY_S = 10.0
"""How often the monitor asks each live server's ``/health``."""
HEALTH_TIMEOUT_S = 10.0
"""How long one ``/health`` may take; a server that fails two asks in a row is lost."""
FAILED_TRIES = 3
"""How many times one request may fail on servers that still answer ``/health`` before it is an error."""
_WAKE_S = 0.5
"""How often a waiting call looks whether its server was lost meanwhile."""


class ServersLostError(RuntimeError):
    """Every rollout server of the run stopped answering; the message names them."""


class RequestFailed(ServerError):
    """One request failed ``FAILED_TRIES`` times on servers that still answer ``/health``."""


class _Lost(Exception):
    """The call's server was lost while the call waited for it."""


@dataclass(eq=False)
class Server:
    client: ServerClient
    launched: LaunchedServer | None = None
    """The process behind it, where the run started it."""
    sender: TcpWeightSender | None = None
    alive: bool = True
    outstanding: int = 0
    """Tokens requested from it and not yet returned (the pool's measure of its load)."""

    @property
    def url(self) -> str:
        return self.client.url


class ServerPool:
    """The run's servers; ``request`` sends one generation request to the least loaded live one."""

    def __init__(self, servers: list[Server]) -> None:
        self.servers = servers
        self.last_answer = time.monotonic()
        """When a request was last answered (``time.monotonic``): the rollouts' progress."""
        self._lock = threading.Lock()
        self._closing = threading.Event()
        self._monitor: threading.Thread | None = None

    @property
    def alive(self) -> list[Server]:
        return [server for server in self.servers if server.alive]

    def request(
        self, route: str, body: dict[str, Any], cost: int, failure: Callable[[Any], str | None]
    ) -> Any:
        """POST ``body`` to ``route`` of the live server with the least outstanding work; where that
        server is lost, to the next, until one answers or none is left (``ServersLostError``).

        ``failure(answer)``: why an answer (HTTP 200) is a failed request, or None. A failed request
        (or an HTTP 5xx) loses its server if ``/health`` then fails; else it is re-sent, and the
        ``FAILED_TRIES``-th failure is a ``RequestFailed`` naming them all."""
        self._start_monitor()
        failed: list[str] = []
        while True:
            server = self._take(cost)
            try:
                answer = self._call(server, lambda server=server: server.client.post(route, body))
                reason = failure(answer)
                if reason is None:
                    self.last_answer = time.monotonic()
                    return answer
                error = ServerError(f"vLLM server {server.url} {reason}")
            except _Lost:
                continue
            except ServerUnreachable as unreachable:
                self.lose(server, unreachable)
                continue
            except ServerError as answered:
                if not answered.server_side:
                    raise  # the request itself is wrong: no server would take it
                error = answered
            finally:
                with self._lock:
                    server.outstanding -= cost
            if not self._healthy(server):
                self.lose(server, error)
                continue
            failed.append(one_line(error, limit=200))
            if len(failed) == FAILED_TRIES:
                raise RequestFailed(
                    f"a rollout request failed {FAILED_TRIES} times on servers that still answer /health, "
                    f"so they were not taken for lost: {'; '.join(failed)}"
                )

    def _call(self, server: Server, call: Callable[[], Any]) -> Any:
        """``call()``'s result; ``_Lost`` as soon as ``server`` is lost meanwhile (the call is left to
        end on its own: a server whose engine died may hold the connection until the time limit)."""
        done = threading.Event()
        outcome: list[Any] = []

        def run() -> None:
            try:
                outcome.append((True, call()))
            except BaseException as error:  # noqa: BLE001 - handed to the waiting thread
                outcome.append((False, error))
            done.set()

        threading.Thread(target=run, name="rollout-server-call", daemon=True).start()
        while not done.wait(_WAKE_S):
            if not server.alive:
                raise _Lost
        succeeded, value = outcome[0]
        if not succeeded:
            raise value
        return value

    def _take(self, cost: int) -> Server:
        with self._lock:
            alive = self.alive
            if not alive:
                raise ServersLostError(
                    f"all {len(self.servers)} rollout servers are lost "
                    f"({', '.join(server.url for server in self.servers)}); see the warnings above"
                )
            server = min(alive, key=lambda candidate: candidate.outstanding)
            server.outstanding += cost
            return server

    def _healthy(self, server: Server) -> bool:
        """Whether ``server`` answers ``/health``, asked twice before it is taken for not answering."""
        return any(server.client.healthy(timeout_s=HEALTH_TIMEOUT_S) for _ in range(2))

    def _start_monitor(self) -> None:
        with self._lock:
            if self._monitor is None and not self._closing.is_set():
                self._monitor = threading.Thread(target=self._watch, name="rollout-health", daemon=True)
                self._monitor.start()

    def _watch(self) -> None:
        """Every ``HEALTH_EVERY_S``: each live server that fails ``/health`` is lost."""
        while not self._closing.wait(HEALTH_EVERY_S):
            for server in self.alive:
                if not self._healthy(server) and not self._closing.is_set():
                    self.lose(server, ServerUnreachable("it stopped answering /health"))

    def lose(self, server: Server, error: BaseException) -> None:
        """Take ``server`` out of the pool, with one warning, and end its process if the run started it.
        While the pool closes (the run ends, Ctrl-C), a server that stops is not lost: no warning."""
        with self._lock:
            if not server.alive:
                return
            server.alive = False
            left = len(self.alive)
        if self._closing.is_set():
            return
        print(
            f"lit-offpolicy: warning: rollout server {server.url} is lost ({one_line(error)}); "
            f"its requests go to the {left} server(s) left",
            file=sys.stderr,
            flush=True,
        )
        if server.launched is not None:  # meanwhile its calls go to the others
            threading.Thread(target=server.launched.stop, name="rollout-server-stop", daemon=True).start()

    def for_each(self, call) -> None:
        """``call(server)`` on every live server; one that fails unreachable, or fails and then fails
        ``/health``, or is lost meanwhile, is lost, not fatal."""
        self._start_monitor()
        for server in self.alive:
            try:
                self._call(server, lambda server=server: call(server))
            except _Lost:
                continue
            except ServerUnreachable as error:
                self.lose(server, error)
            except ServerError as error:
                if self._healthy(server):
                    raise
                self.lose(server, error)
        if not self.alive:
            raise ServersLostError(f"all {len(self.servers)} rollout servers are lost")

    def close(self) -> None:
        """Stop the monitor, close the connections and stop the servers the run launched; none of them
        is reported lost."""
        self._closing.set()
        for server in self.servers:
            if server.sender is not None:
                server.sender.close()
            server.client.close()
            if server.launched is not None:
                server.launched.stop()
