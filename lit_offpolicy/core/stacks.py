"""``kill -USR2 <pid>``: where a run that seems stuck is, without py-spy or a debugger; and where a
process that crashes in native code (SIGSEGV, SIGABRT) was."""

from __future__ import annotations

import faulthandler
import signal
import sys


def stacks_on_sigusr2() -> None:
    """SIGUSR2 prints every thread's Python stack and the process goes on (Python's ``faulthandler``,
    which also answers during the interpreter's shutdown). The stacks go to the process's own stderr
    (``sys.__stderr__``), whatever replaced ``sys.stderr``. A requeue signal set to SIGUSR2 takes the
    signal over (``PreemptionCheckpoint``)."""
    if sys.__stderr__ is not None:
        faulthandler.register(signal.SIGUSR2, file=sys.__stderr__, all_threads=True, chain=False)


def stacks_on_crash() -> None:
    """A crash in native code (a segmentation fault in a rank, which Lightning's launcher reports only as
    "terminated with code -11") prints every thread's Python stack first."""
    if sys.__stderr__ is not None:
        faulthandler.enable(file=sys.__stderr__, all_threads=True)
