"""Rank 0 as the parent of the other ranks (Lightning's local launcher): whether it is gone, and a watch
for the time before the process group forms, when no collective can tell.

Lightning starts ranks 1 … N − 1 of a node by running rank 0's command again, as its children. Once the
group has formed, a rank whose rank 0 was killed finds out at its next collective (gloo: "Connection
closed by peer"). Before that, it waited up to 30 minutes (Lightning's timeout) to reach rank 0's store,
then ended with a traceback.
"""

from __future__ import annotations

import os
import re
import sys
import threading
import time
from pathlib import Path

import torch.distributed as dist

from lit_offpolicy.core.distributed import peer_gone

_started_by: int | None = None
"""The pid of this rank's rank 0 (its parent), where one started it; None otherwise."""
_told = threading.Lock()


def note_rank_zero() -> None:
    """Remember the parent as rank 0 where this process is a rank other than 0 (``LOCAL_RANK``) whose
    parent runs the same command; a parent that is a shell, torchrun or srun is not."""
    global _started_by
    parent, arguments = os.getppid(), sys.argv[1:]
    try:
        command = Path(f"/proc/{parent}/cmdline").read_bytes().decode(errors="replace").split("\0")[:-1]
    except OSError:
        return
    same = bool(arguments) and len(command) > len(arguments) and command[-len(arguments) :] == arguments
    if os.environ.get("LOCAL_RANK", "0") != "0" and same:
        _started_by = parent


def rank_zero_gone(wait_s: float = 0.0) -> bool:
    """Whether the rank 0 that started this rank has ended (this process was handed to another parent);
    ``wait_s``: as long as that may take to show (a killed process's sockets close before it is reaped)."""
    if _started_by is None:
        return False
    deadline = time.monotonic() + wait_s
    while os.getppid() == _started_by:
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.05)
    return True


def rank_zero_reason(error: BaseException) -> str | None:
    """Where ``error`` came of rank 0's end (``rank_zero_gone``, given 2 s to show after a failed
    collective or store call): the first sentence of its message, without c10d's source location and
    the peer's address (``Connection closed by peer [127.0.0.1]:4994``: rank 0 is named already)."""
    lost = isinstance(error, dist.DistError) or peer_gone(error) is not None
    if not rank_zero_gone(wait_s=2.0 if lost else 0.0):
        return None
    first = str(error).split("\n", 1)[0].split("] ", 1)[-1].split(". ", 1)[0]
    return re.sub(r"\s*\[[^\]]*\]:\d+", "", first)


def rank_zero_name() -> str:
    """``trainer rank R`` of the rank that started this one: rank 0 on the first node."""
    local = int(os.environ.get("LOCAL_RANK", "0"))
    if dist.is_available() and dist.is_initialized():
        return f"trainer rank {dist.get_rank() - local}"
    node = os.environ.get("NODE_RANK", "0")
    return "trainer rank 0" if node == "0" else f"trainer local rank 0 of node {node}"


def tell_rank_zero_gone(reason: str, then: str = "") -> None:
    """``lit-offpolicy: error: trainer rank 0 is gone (REASON); this rank stops`` and ``then``, once a
    process."""
    if _told.acquire(blocking=False):
        line = f"lit-offpolicy: error: {rank_zero_name()} is gone ({reason}); this rank stops{then}"
        print(line, file=sys.stderr, flush=True)


def watch_rank_zero(poll_s: float = 0.5) -> None:
    """Until the process group has formed: once rank 0 is gone, say so and end this process (exit
    status 2); its main thread may be inside the store's connect, which no exception reaches."""
    if _started_by is None:
        return

    def watch() -> None:
        while not (dist.is_available() and dist.is_initialized()):
            if rank_zero_gone():
                tell_rank_zero_gone(
                    "its process ended before the ranks met: killed, or failed: then its output says why"
                )
                os._exit(2)
            time.sleep(poll_s)

    threading.Thread(target=watch, name="rank-zero-watch", daemon=True).start()
