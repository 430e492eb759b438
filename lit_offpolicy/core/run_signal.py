"""How many signals asked this process's runs to stop (SIGTERM, SIGINT, SIGUSR1 or the requeue signal),
for the parts whose next failure is then the signal's doing: the rollout servers a run launched are in
its process group, their watchdogs end them on SIGTERM, and their going is no loss to warn about. A part
notes ``count()`` as it starts and compares later, so a signal to an earlier run in the same process
(tests run many) never counts for it. ``training.checkpointing.PreemptionCheckpoint`` calls ``note``."""

from __future__ import annotations

_count = 0


def note() -> None:
    """A signal asked the run to stop."""
    global _count
    _count += 1


def count() -> int:
    return _count
