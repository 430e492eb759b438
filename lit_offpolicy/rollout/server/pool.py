"""Requests over a pool of vLLM servers: least outstanding work first, a prompt's group on one server,
a lost server's requests re-sent to the others."""

from __future__ import annotations

import sys
import threading
from dataclasses import dataclass
from typing import Any

from lit_offpolicy.core.messages import one_line
from lit_offpolicy.rollout.server.client import ServerClient, ServerError, ServerUnreachable
from lit_offpolicy.rollout.server.process import LaunchedServer
from lit_offpolicy.rollout.server.tcp_sender import TcpWeightSender


class ServersLostError(RuntimeError):
    """Every rollout server of the run stopped answering; the message names them."""


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
        self._lock = threading.Lock()

    @property
    def alive(self) -> list[Server]:
        return [server for server in self.servers if server.alive]

    def request(self, route: str, body: dict[str, Any], cost: int) -> Any:
        """POST ``body`` to ``route`` of the live server with the least outstanding work; where that
        server is lost, to the next, until one answers or none is left (``ServersLostError``)."""
        while True:
            server = self._take(cost)
            try:
                return server.client.post(route, body)
            except ServerUnreachable as error:
                self.lose(server, error)
            except ServerError as error:
                if server.client.healthy():
                    raise
                self.lose(server, error)
            finally:
                with self._lock:
                    server.outstanding -= cost

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

    def lose(self, server: Server, error: BaseException) -> None:
        """Take ``server`` out of the pool, with one warning, and end its process if the run started it."""
        with self._lock:
            if not server.alive:
                return
            server.alive = False
            left = len(self.alive)
        print(
            f"lit-offpolicy: warning: rollout server {server.url} is lost ({one_line(error)}); "
            f"its requests go to the {left} server(s) left",
            file=sys.stderr,
            flush=True,
        )
        if server.launched is not None:
            server.launched.stop(timeout_s=5.0)

    def for_each(self, call) -> None:
        """``call(server)`` on every live server; one that fails unreachable is lost, not fatal."""
        for server in self.alive:
            try:
                call(server)
            except ServerUnreachable as error:
                self.lose(server, error)
        if not self.alive:
            raise ServersLostError(f"all {len(self.servers)} rollout servers are lost")

    def close(self) -> None:
        for server in self.servers:
            if server.sender is not None:
                server.sender.close()
            server.client.close()
            if server.launched is not None:
                server.launched.stop()
