"""A launched server's watchdog: ``python .../supervise.py -- CMD...`` (run by path, it imports
nothing of lit-offpolicy, so it starts in a few milliseconds).

It runs CMD (a vLLM server) in a process group of its own and ends that whole group, engine core
and workers included, when any of these happens:

* the trainer that started it exits, however (SIGKILL too): its parent process changes;
* it gets SIGTERM or SIGHUP (the trainer's teardown, or a signal to the run's process group);
* the server itself exits, e.g. killed: vLLM's engine core would otherwise outlive a SIGKILLed API
  server, orphaned.

If the watchdog itself dies (SIGKILL to the run's whole process group, an OOM kill), the server gets
SIGTERM (Linux's parent-death signal), and the watchdog's guard (``supervise.py --guard PGID PID``, in a
session of its own, out of the group's reach) ends the server's group as the watchdog would have: a
vLLM server can sit on a SIGTERM while it waits for a request of the dead trainer.

SIGINT is ignored: Ctrl-C in a terminal goes to the run's whole process group, and the trainer
finishes its step (on the servers), saves, exports and then stops them itself; the watchdog still
ends them if the trainer exits instead.

The server's RPC sockets go to a directory of its own (``VLLM_RPC_BASE_PATH``), which the watchdog,
or the guard, removes once the group has ended: vLLM leaves them (7 at each start) in the temporary
directory, however it is stopped. Its other temporary files stay where they were: torch's compile
cache, whose precompiled headers follow ``TMPDIR`` whatever ``TORCHINDUCTOR_CACHE_DIR`` says, is shared.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

POLL_S = 0.2
GRACE_S = 10.0
"""How long the server has to shut down on SIGTERM before its group is SIGKILLed."""
_PR_SET_PDEATHSIG = 1
RESOURCE_TRACKER = b"multiprocessing.resource_tracker"
GUARD = "--guard"
"""The argument that runs this file as a watchdog's guard (``supervise.py --guard PGID WATCHDOG_PID DIR``)."""


def _die_with_parent() -> None:
    """In the child, before exec: SIGTERM when the watchdog dies (Linux)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


def end_group(server: subprocess.Popen) -> None:
    """SIGTERM the server's group, wait up to ``GRACE_S`` for all of it to exit, then SIGKILL what is left."""
    _end_group(server.pid, lambda: server.poll() is None or _signal_group(server.pid, 0))


def _end_group(pgid: int, running) -> None:
    _signal_group(pgid, signal.SIGTERM)
    _signal_group(pgid, signal.SIGCONT)  # a stopped (SIGSTOP) server takes its SIGTERM now
    _wait_while(running)
    kill_group(pgid)  # the resource tracker is spared: it cleans up, then exits
    _wait_while(running)
    _signal_group(pgid, signal.SIGKILL)


def _wait_while(running) -> None:
    """Up to ``GRACE_S``, while ``running()``."""
    deadline = time.monotonic() + GRACE_S
    while time.monotonic() < deadline and running():
        time.sleep(POLL_S)


def kill_group(pgid: int) -> None:
    """SIGKILL every process of the group but Python's resource tracker (which ignores SIGTERM): once the
    others are gone it unlinks the shared memory they leave in /dev/shm (vLLM's engine core and worker
    share 2 segments, 400 MiB for the tiny model), then exits by itself. Without /proc (not Linux): the
    whole group, the tracker too."""
    if not os.path.isdir("/proc"):
        _signal_group(pgid, signal.SIGKILL)
        return
    for pid in _members(pgid):
        with contextlib.suppress(OSError):
            with open(f"/proc/{pid}/cmdline", "rb") as cmdline:
                if RESOURCE_TRACKER in cmdline.read():
                    continue
            os.kill(pid, signal.SIGKILL)


def _members(pgid: int) -> list[int]:
    members = []
    for entry in os.listdir("/proc"):
        with contextlib.suppress(OSError, ValueError):
            if os.getpgid(int(entry)) == pgid:
                members.append(int(entry))
    return members


def guard(pgid: int, watchdog: int, scratch: str) -> int:
    """Until the ``watchdog`` that started this process dies (this process's parent is another) or the
    group ``pgid`` is gone; then end the group and remove its ``scratch`` directory. (The watchdog's
    pid, not the parent seen at start: the watchdog may be dead before this process has started.)"""
    while os.getppid() == watchdog and _signal_group(pgid, 0):
        time.sleep(POLL_S)
    _end_group(pgid, lambda: _signal_group(pgid, 0))
    shutil.rmtree(scratch, ignore_errors=True)
    return 0


def _signal_group(pgid: int, sig: int) -> bool:
    """Send ``sig`` to the group; whether any process of it was there."""
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        return False
    return True


def main(argv: list[str]) -> int:
    if argv[:1] == [GUARD]:
        return guard(int(argv[1]), int(argv[2]), argv[3])
    command = argv[argv.index("--") + 1 :] if "--" in argv else argv
    if not command:
        print("usage: python supervise.py -- COMMAND... | --guard PGID WATCHDOG_PID DIR", file=sys.stderr)
        return 2
    parent = os.getppid()
    stop = []
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, lambda number, frame: stop.append(number))
    signal.signal(signal.SIGINT, lambda number, frame: None)  # not SIG_IGN: the server would inherit it
    scratch = tempfile.mkdtemp(prefix="lit-offpolicy-server-")
    try:
        server = subprocess.Popen(
            command,
            start_new_session=True,
            preexec_fn=_die_with_parent,
            env={**os.environ, "VLLM_RPC_BASE_PATH": scratch},
        )
        watch = subprocess.Popen(
            [sys.executable, __file__, GUARD, str(server.pid), str(os.getpid()), scratch],
            start_new_session=True,
        )
        while not stop and os.getppid() == parent and server.poll() is None:
            time.sleep(POLL_S)
        end_group(server)
        watch.kill()  # the group is ended: its guard has nothing left to do
        watch.wait()
        code = server.wait()
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    if stop:
        return 128 + stop[0]
    return 128 - code if code < 0 else code  # a server killed by signal N: 128 + N, as a shell says


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
