"""Several ``lit-offpolicy`` commands one after another in the same trainer ranks, for the multi-rank
CLI tests (tests/integration/test_sequence_parallel_fit.py).

    python tests/helpers/cli_fits.py RUNS.json

RUNS.json: a list of argument lists, each what ``lit-offpolicy`` is given (``["fit", "--config", ...]``),
all with the same ``--trainer.devices``. Each runs through ``lit_offpolicy.cli.main`` as the console
script runs it (a new parser, Trainer, module and data each time); Lightning starts the other ranks at
the first fit by running this same command again, and rank 0's ``LOCAL_RANK`` keeps it from starting
them again. The one change to the CLI is that its ``destroy_process_group`` at the end of a command waits
for the last one: the next fit uses the same process group, so that N fits cost one start-up of each
rank (about 7 s of one core: torch, Lightning and transformers imports), not N. Before each command
rank 0 prints ``cli_fits: command K`` to stderr. The first command that fails ends the rank with its
exit status. The commands may differ in anything but the number of ranks (strategy, config, output).

From a test: a module fixture writes RUNS.json, runs this file with ``subprocess.run`` (environment
``helpers.subprocess_env()``, so that ``helpers`` imports in every rank), asserts exit status 0 and
splits the captured stderr at ``cli_fits: command `` to give each test its command's output; each
command writes to its own directory (tests/integration/test_sequence_parallel_fit.py's ``runs``).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from unittest import mock

from lit_offpolicy.cli import command, main
from lit_offpolicy.core.distributed import destroy_process_group


def run_all(runs: list[list[str]]) -> int:
    """Run each command of ``runs`` in order; the exit status of the first that fails, else 0."""
    with mock.patch.object(command, "destroy_process_group", lambda: None):
        for index, args in enumerate(runs):
            if os.environ.get("LOCAL_RANK", "0") == "0":
                print(f"cli_fits: command {index}", file=sys.stderr, flush=True)
            try:
                main(args)
            except SystemExit as stop:
                if stop.code not in (None, 0):
                    return stop.code if isinstance(stop.code, int) else 1
    return 0


if __name__ == "__main__":
    status = run_all(json.loads(Path(sys.argv[1]).read_text()))
    destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    # as tests/helpers/ddp_rl_fit.py: gloo objects that an FSDP2 device mesh still references can abort
    # the interpreter's finalisation (SIGABRT) after every output is written
    os._exit(status)
