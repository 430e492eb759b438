"""Whether a signal asked this process's run to stop (SIGTERM, SIGINT, SIGUSR1 or the requeue signal),
for the parts whose next failure is the signal's doing: the rollout servers a run launched are in its
process group, their watchdogs end them on SIGTERM, and their going is then no loss to warn about.
``training.checkpointing.PreemptionCheckpoint`` sets it; it is cleared as a run starts."""

from __future__ import annotations

import signal

_received: signal.Signals | None = None


def note(received: signal.Signals | None) -> None:
    """Record ``received`` (None: a run starts, nothing received yet)."""
    global _received
    _received = received


def received() -> signal.Signals | None:
    return _received
