"""The local SLURM cluster's reaper (tests/helpers/slurm_cluster.py): ``python slurm_reaper.py ROOT
OWNER_PID``, run by path in a session of its own (standard library only: it is up in milliseconds).

When the test process that started the cluster (``OWNER_PID``, the reaper's parent) is gone without
``LocalSlurm.stop()`` (Ctrl-C, which pytest-xdist answers by ending its workers; a SIGKILL), it kills
every process that carries the cluster's marker in its environment (the daemons, ``slurmstepd``, the
jobs' steps and tasks: they are in sessions of their own, out of reach of a signal to the test's
group) and removes ``ROOT``. ``stop()`` ends the reaper once it has done that itself.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import sys
import time
from pathlib import Path

MARKER = "LIT_OFFPOLICY_TEST_SLURM"
"""In every daemon's and job's environment, with the cluster's root as its value."""
POLL_S = 0.5


def processes_with(entry: str) -> list[int]:
    """The processes whose environment holds ``entry`` (``NAME=value``), this one excepted."""
    needle = entry.encode() + b"\0"
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit() or int(proc.name) == os.getpid():
            continue
        try:
            environ = (proc / "environ").read_bytes()
        except OSError:  # gone, or not ours to read
            continue
        if environ.startswith(needle) or b"\0" + needle in environ:
            found.append(int(proc.name))
    return found


def kill_cluster(root: str) -> None:
    """SIGKILL what carries ``root``'s marker until none is left (a daemon may fork meanwhile)."""
    for _ in range(20):
        pids = processes_with(f"{MARKER}={root}")
        if not pids:
            return
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(POLL_S)


def main(root: str, owner: int) -> int:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the owner's to answer, not the reaper's
    while os.getppid() == owner:
        time.sleep(POLL_S)
    kill_cluster(root)
    shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], int(sys.argv[2])))
