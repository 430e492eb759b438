"""Requests over a pool of vLLM servers: least outstanding work first, a prompt's group on one server,
a lost server's requests re-sent to the others.

A server is lost when it does not answer (refused, reset, past ``request_timeout_s``), or when it
fails a request (an HTTP 5xx, a response that ends with ``abort``: its engine core died under a live
API server) and then fails its ``/health`` too. Once the pool is in use, a monitor asks every live
server's ``/health`` every ``HEALTH_EVERY_S``: a server that stops answering (an API server whose
engine core died may hold its connections open and answer nothing) is lost within seconds, not at
its calls' time limit, and the calls waiting on it are re-sent or skipped. A request that fails on a
server that is still healthy is re-sent at most ``FAILED_TRIES`` times in all, then ends the run
with its reasons. A lost server may come back (``healing``) and rejoin at the current weights.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from lit_offpolicy.core import run_signal
from lit_offpolicy.core.messages import one_line
from lit_offpolicy.rollout.server.client import ServerClient, ServerError, ServerUnreachable
from lit_offpolicy.rollout.server.healing import Healer
from lit_offpolicy.rollout.server.process import LaunchedServer
from lit_offpolicy.rollout.server.shm_sender import ShmWeightSender
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
    sender: TcpWeightSender | ShmWeightSender | None = None
    alive: bool = True
    lost_because: str | None = None
    """Why this process lost it (one line), where it did."""
    outstanding: int = 0
    """Tokens requested from it and not yet returned (the pool's measure of its load)."""
    ready: bool = False
    """Lost, and back (``healing``): it answers again and waits for the next weight push to rejoin."""
    joining: bool = False
    """Back in the pool for a weight push, which brings it to the current version; no generation yet."""
    comebacks: int = 0
    """How many times it came back; the ranks' agreement tells this one from the one that was lost."""

    @property
    def url(self) -> str:
        return self.client.url


class ServerPool:
    """The run's servers; ``request`` sends one generation request to the least loaded live one.

    ``warns``: a lost server is told on stderr (False on trainer ranks other than 0, whose losses
    rank 0 tells once the ranks agree on them: ``VLLMServerEngine.agree_on_servers``). ``max_restarts``:
    a lost server is brought back (``healing.Healer``; 0: it stays out)."""

    def __init__(
        self,
        servers: list[Server],
        warns: bool = True,
        max_restarts: int = 0,
        startup_timeout_s: float = 300.0,
    ) -> None:
        self.servers = servers
        self.warns = warns
        self.last_answer = time.monotonic()
        """When a request was last answered (``time.monotonic``): the rollouts' progress."""
        self._lock = threading.Lock()
        self.closing = threading.Event()
        self._ended_by_signal = 0
        """Servers that went without a warning, after a signal asked the run to stop (``lose``)."""
        self._signals_before = run_signal.count()
        self._monitor: threading.Thread | None = None
        self.healer = Healer(self, max_restarts, startup_timeout_s) if max_restarts else None

    @property
    def alive(self) -> list[Server]:
        """The servers in the pool: those that serve and those joining."""
        return [server for server in self.servers if server.alive]

    @property
    def restarts(self) -> int:
        """Comebacks of the run's servers: rank 0's, which the others learn where the ranks meet."""
        return sum(server.comebacks for server in self.servers)

    def signalled(self) -> bool:
        """Whether a signal asked the run to stop since the pool was made."""
        return run_signal.count() > self._signals_before

    @property
    def serving(self) -> list[Server]:
        """The servers that take generation requests."""
        return [server for server in self.servers if server.alive and not server.joining]

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
        """The serving server with the least outstanding work; while the only servers left are joining
        (a push is bringing them back), it waits for them."""
        while True:
            with self._lock:
                if not self.alive:
                    raise self._all_lost()
                serving = self.serving
                if serving:
                    server = min(serving, key=lambda candidate: candidate.outstanding)
                    server.outstanding += cost
                    return server
            time.sleep(_WAKE_S)

    def _healthy(self, server: Server) -> bool:
        """Whether ``server`` answers ``/health``, asked twice before it is taken for not answering."""
        return any(server.client.healthy(timeout_s=HEALTH_TIMEOUT_S) for _ in range(2))

    def _start_monitor(self) -> None:
        with self._lock:
            if self._monitor is None and not self.closing.is_set():
                self._monitor = threading.Thread(target=self._watch, name="rollout-health", daemon=True)
                self._monitor.start()

    def _watch(self) -> None:
        """Every ``HEALTH_EVERY_S``: each live server that fails ``/health`` is lost."""
        while not self.closing.wait(HEALTH_EVERY_S):
            for server in self.alive:
                if not self._healthy(server) and not self.closing.is_set():
                    self.lose(server, ServerUnreachable("it stopped answering /health"))

    def lose(self, server: Server, error: BaseException) -> None:
        """Take ``server`` out of the pool, with one warning, end its process if the run started it, and
        bring it back where the pool heals. While the pool closes (the run ends), or after a signal asked
        the run to stop (its watchdog, in the run's process group, ends a launched server on SIGTERM), a
        server that stops is no news: no warning."""
        with self._lock:
            if not server.alive:
                return
            server.alive = server.joining = False
            server.lost_because = one_line(error)
            left = len(self.serving)
        if self.closing.is_set():
            return
        if server.launched is not None and self.signalled():
            self._ended_by_signal += 1
            return
        if self.warns:
            log = f"; its log: {server.launched.log_file}" if server.launched is not None else ""
            print(
                f"lit-offpolicy: warning: rollout server {server.url} is lost ({server.lost_because}{log}); "
                f"its requests go to the {left} server(s) left",
                file=sys.stderr,
                flush=True,
            )
        if self.healer is not None:  # meanwhile its calls go to the others
            self.healer.heal(server)
        elif server.launched is not None:
            threading.Thread(target=server.launched.stop, name="rollout-server-stop", daemon=True).start()

    def replace_process(self, server: Server) -> LaunchedServer | None:
        """Start ``server``'s process again (``LaunchedServer.again``); None where the pool closes."""
        with self._lock:
            if self.closing.is_set():
                return None
            server.launched = server.launched.again()
            return server.launched

    def make_ready(self, server: Server) -> None:
        """``server`` answers again: the next weight push admits it (``admit_ready``)."""
        with self._lock:
            server.ready = not self.closing.is_set()

    def admit_ready(self) -> list[Server]:
        """The servers that are back, now in the pool as joining: a weight push reaches them, generation
        requests do not (``rejoin`` ends that)."""
        with self._lock:
            joining = [server for server in self.servers if server.ready]
            for server in joining:
                server.ready, server.alive, server.joining = False, True, True
        return joining

    def rejoin(self, version: int) -> None:
        """The joining servers that took the push of ``version`` serve again, one line each."""
        with self._lock:
            rejoined = [server for server in self.alive if server.joining]
            for server in rejoined:
                server.joining, server.lost_because = False, None
                server.comebacks += 1
        for server in rejoined:
            if self.warns:
                print(
                    f"lit-offpolicy: rollout server {server.url} is back at version {version}; "
                    f"{len(self.serving)} of {len(self.servers)} serve",
                    file=sys.stderr,
                    flush=True,
                )

    @staticmethod
    def state(server: Server) -> int:
        """``3 * comebacks + {serving: 0, lost: 1, joining: 2}``: of two ranks' states of one server, the
        larger is the later news (rank 0 alone brings servers back)."""
        return 3 * server.comebacks + (2 if server.joining else 0 if server.alive else 1)

    def agree(self, states: list[int]) -> list[Server]:
        """Take the ranks' agreed ``states`` (``state``'s, reduced by MAX): a server that came back serves
        here too; the serving servers that are now lost or joining are returned (to be lost here)."""
        gone = []
        with self._lock:
            for server, agreed in zip(self.servers, states, strict=True):
                comebacks, kind = divmod(agreed, 3)
                if comebacks > server.comebacks:
                    server.comebacks, server.alive, server.joining = comebacks, True, False
                    server.lost_because = None
                if kind and server.alive and not server.joining:
                    gone.append(server)
        return gone

    def for_each(self, call) -> None:
        """``call(server)`` on every server in the pool (joining ones too); one that fails unreachable, or
        fails and then fails ``/health``, or is lost meanwhile, is lost, not fatal."""
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
            raise self._all_lost()

    def _all_lost(self) -> ServersLostError:
        urls = ", ".join(server.url for server in self.servers)
        if self._ended_by_signal == len(self.servers):
            return ServersLostError(
                f"the {len(self.servers)} rollout servers it launched ended with the signal ({urls})"
            )
        if self._ended_by_signal:
            return ServersLostError(
                f"{self._ended_by_signal} of the {len(self.servers)} rollout servers ended with the signal, "
                f"the others were lost before ({urls}); see the warnings above"
            )
        return ServersLostError(
            f"all {len(self.servers)} rollout servers are lost ({urls}); see the warnings above"
        )

    def close(self) -> None:
        """Stop the monitor and the healing, close the connections and stop the servers the run
        launched; none of them is reported lost."""
        with self._lock:
            self.closing.set()
        for server in self.servers:
            if server.sender is not None:
                server.sender.close()
            server.client.close()
            if server.launched is not None:
                server.launched.stop()
