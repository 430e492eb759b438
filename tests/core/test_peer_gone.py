"""A collective whose peer process has ended: the error a rank gets, and the one line the CLI makes of it
(``core.distributed.peer_gone``), on a real two-process gloo group."""

import subprocess
import sys
import textwrap

import pytest

from lit_offpolicy.core.distributed import peer_gone
from lit_offpolicy.rollout.server.process import free_port

# rank argv[1] of 2 on port argv[2]: rank 0 ends as a killed process does (no goodbye to the group),
# rank 1 then calls a collective and prints what peer_gone makes of its error
RANK = textwrap.dedent(
    """
    import os, sys
    from datetime import timedelta
    import torch, torch.distributed as dist
    rank = int(sys.argv[1])
    if rank == 1:  # the rank left behind (Lightning's import, 10 CPU s): rank 0 waits at the barrier
        from lit_offpolicy.core.distributed import peer_gone
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[2])
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=timedelta(seconds=300))
    dist.barrier()
    if rank == 0:
        os._exit(0)
    try:
        dist.all_reduce(torch.ones(1))
        print("no error")
    except RuntimeError as error:
        print(repr(peer_gone(error)), "from", str(error)[:300])
    os._exit(0)
    """
)


@pytest.mark.slow  # real processes, no floats: not part of test-numerics
def test_a_collective_after_the_other_rank_ended_is_named_as_such():
    port = str(free_port())
    ranks = [
        subprocess.Popen([sys.executable, "-c", RANK, str(rank), port], stdout=subprocess.PIPE, text=True)
        for rank in range(2)
    ]
    answer = ranks[1].communicate(timeout=120)[0]
    ranks[0].wait(timeout=30)
    named = answer.split(" from ", 1)[0]  # "Connection closed by peer [ADDR]:PORT", or "Read error ..."
    assert named.startswith("'") and "by peer" in named and "GLHF" not in named, answer


def test_other_errors_are_not_a_lost_peer():
    assert peer_gone(RuntimeError("CUDA out of memory")) is None
    assert peer_gone(ConnectionError("Connection reset by peer")) is None  # a server's, not a rank's


# the same two ranks; rank 1 then leaves as a preempted run does (``leave_after_rank_zero``)
LEAVING = RANK[: RANK.index("try:")] + textwrap.dedent(
    """
    from lit_offpolicy.cli.command import leave_after_rank_zero
    leave_after_rank_zero(timeout_s=0.1)
    print("left")
    """
)


@pytest.mark.slow  # real processes
def test_a_rank_leaving_after_its_peer_ended_goes_without_an_error():
    """SLURM's requeue ends every task at once: the rank left behind at the last barrier of a preempted
    run ends as preempted, not with the barrier's error (exit 1 and a traceback in the job's log)."""
    port = str(free_port())
    ranks = [
        subprocess.Popen(
            [sys.executable, "-c", LEAVING, str(rank), port],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in range(2)
    ]
    out, err = ranks[1].communicate(timeout=120)
    ranks[0].wait(timeout=30)
    assert out.strip() == "left" and "Traceback" not in err, err[-2000:]
