"""A rank whose rank 0 was SIGKILLed prints one line and stops (``lit_offpolicy.cli.rank_zero``), on real
processes as Lightning's local launcher makes them: rank 0 starts rank 1 by running its own command again
(``LOCAL_RANK=1``), then kills itself. Rank 1 runs the CLI's ``main`` with the fit standing in: its next
collective, or the group's forming (rank 0's store, which rank 1 waited 30 minutes for)."""

import re
import subprocess
import sys
import textwrap

import pytest

from lit_offpolicy.rollout.server.process import free_port

# argv[1]: the port; argv[2]: "collective" (rank 0 dies once the group has formed) or "forming" (before,
# once rank 1's fit has begun: argv[3] exists)
RANKS = textwrap.dedent(
    """
    import os, signal, subprocess, sys, time
    from datetime import timedelta
    from pathlib import Path
    import torch, torch.distributed as dist
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[1], WORLD_SIZE="2")
    group = dict(backend="gloo", world_size=2, timeout=timedelta(seconds=30))
    began = Path(sys.argv[3])
    if os.environ.get("LOCAL_RANK", "0") == "0":
        subprocess.Popen([sys.executable, *sys.orig_argv[1:]], env={**os.environ, "LOCAL_RANK": "1"})
        if sys.argv[2] == "collective":
            dist.init_process_group(rank=0, **group)
            dist.barrier()
        while not began.exists():
            time.sleep(0.05)
        os.kill(os.getpid(), signal.SIGKILL)
    import lit_offpolicy.cli.command as command

    def fit(*args, **kwargs):
        began.touch()
        dist.init_process_group(rank=1, **group)
        dist.barrier()  # rank 0 is there, or gone
        dist.all_reduce(torch.ones(1))

    command.OffPolicyCLI = fit
    try:
        command.main(["fit"])
    except SystemExit as stop:
        print("exit", stop.code, flush=True)
    """
)


@pytest.mark.slow  # real processes
@pytest.mark.parametrize("when", ["collective", "forming"])
def test_the_rank_left_by_a_killed_rank_zero_says_so_in_one_line(when, tmp_path):
    rank_zero = subprocess.Popen(
        [sys.executable, "-c", RANKS, str(free_port()), when, str(tmp_path / "began")],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    out, err = rank_zero.communicate(timeout=120)  # until rank 1, which holds the pipes too, has ended
    assert "Traceback" not in err, err[-3000:]
    (line,) = [line for line in err.splitlines() if line.startswith("lit-offpolicy:")]
    assert line.startswith("lit-offpolicy: error: trainer rank 0 is gone ("), line
    if when == "collective":  # gloo's reason: "Connection closed by peer" (no address), or "Read error"
        reason = r"\((Connection closed by peer|Read error[^\[]*)\)"
        assert re.search(reason + "; this rank stops; resume with --ckpt_path last$", line), line
        assert out.strip() == "exit 2", out
    else:  # ended by the watch, from outside the store's connect: os._exit(2), no word on stdout
        assert line.endswith(
            "(its process ended before the ranks met: killed, or failed: then its output says "
            "why); this rank stops"
        ), line
        assert out == "", out
