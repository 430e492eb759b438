"""Lost rollout servers come back: a launched one is started again on its port, a given URL is asked
``/health`` until it answers; either then rejoins the pool at the run's current weights.

A server that is back is *ready*; the next weight push (``VLLMServerEngine.load_weights``) admits it
(``ServerPool.admit_ready``: it is pushed to but takes no generation yet), brings it to the version it
pushes, and then it serves again (``ServerPool.rejoin``): every token it samples is labelled with a
version the trainer pushed. A launched server's restarts wait ``RESTART_DELAY_S``, doubled after each
start that fails; ``max_restarts`` starts in a row that fail leave it out of the run, with one line.
"""

from __future__ import annotations

import sys
import threading
from typing import TYPE_CHECKING

from lit_offpolicy.core.messages import one_line
from lit_offpolicy.rollout.server.client import ServerError

if TYPE_CHECKING:
    from lit_offpolicy.rollout.server.pool import Server, ServerPool

RESTART_DELAY_S = 2.0
"""Wait before a lost launched server's first restart; doubled after each start that fails."""
MAX_DELAY_S = 60.0
"""The longest wait between two starts of a launched server."""
PROBE_EVERY_S = 10.0
"""How often a lost server given by URL is asked whether it answers again."""


class Healer:
    """Brings the lost servers of ``pool`` back, each in a thread of its own, until the pool closes or
    a signal asks the run to stop. ``max_restarts``: starts in a row that may fail before a launched
    server is left out (0: a lost server stays out, launched or given)."""

    def __init__(self, pool: ServerPool, max_restarts: int, startup_timeout_s: float) -> None:
        self.pool = pool
        self.max_restarts = max_restarts
        self.startup_timeout_s = startup_timeout_s

    def heal(self, server: Server) -> None:
        """End what is left of ``server``'s processes (where the run launched it) and bring it back."""
        threading.Thread(
            target=self._bring_back, args=(server,), name="rollout-server-heal", daemon=True
        ).start()

    def _stopping(self) -> bool:
        return self.pool.closing.is_set() or self.pool.signalled()

    def _bring_back(self, server: Server) -> None:
        if server.launched is not None:
            server.launched.kill()
        failed = 0
        while not self._stopping():
            if server.launched is None:  # a given URL: ask until it answers
                if self.pool.closing.wait(PROBE_EVERY_S):
                    return
                if server.client.healthy(timeout_s=PROBE_EVERY_S):
                    self.pool.make_ready(server)
                    return
                continue
            if failed == self.max_restarts:
                self._say(
                    f"rollout server {server.url} is left out of the run: {failed} starts in a row failed "
                    f"(max_restarts={self.max_restarts}; the last: {server.lost_because})"
                )
                return
            if self.pool.closing.wait(min(RESTART_DELAY_S * 2**failed, MAX_DELAY_S)):
                return
            if self._restarted(server, attempt=failed + 1):
                self.pool.make_ready(server)
                return
            failed += 1

    def _restarted(self, server: Server, attempt: int) -> bool:
        """Start ``server``'s process again and wait for its ``/health``; False, with one line, where it
        does not come up."""
        self._say(
            f"rollout server {server.url} starts again (start {attempt} of max_restarts={self.max_restarts}; "
            f"{'lost' if attempt == 1 else 'the last start failed'}: {server.lost_because})"
        )
        started = self.pool.replace_process(server)
        if started is None:  # the pool closed meanwhile
            return False
        try:
            started.wait_healthy(server.client, self.startup_timeout_s, report=False)
        except ServerError as error:
            started.stop()
            server.lost_because = one_line(error, limit=300)
            return False
        return True

    def _say(self, line: str) -> None:
        if not self._stopping():
            print(f"lit-offpolicy: warning: {line}", file=sys.stderr, flush=True)
