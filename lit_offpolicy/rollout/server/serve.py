"""Start one rollout server by hand (or from a SLURM script) for ``VLLMServerSpec(urls=[...])``:

    python -m lit_offpolicy.rollout.server.serve --model DIR --port 8000 [vllm serve options...]

It becomes (``exec``) vLLM's own OpenAI-compatible server with the options the rollout engine needs
(``process.REQUIRED_OPTIONS``) and its RL routes mounted; every other option is vLLM's, passed on
as given (on a CPU: ``--dtype float32``). lit-offpolicy must be installed beside vLLM: its weight
transfer backend is a vLLM plugin.

SIGUSR1 is ignored: it is SLURM's warning before a preemption or the time limit (``--signal=USR1@90``),
sent to every step of the job; the trainer saves and requeues the job on it, and needs the servers to
finish its step. The requeue ends them, and the requeued job starts them again.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys

from lit_offpolicy.rollout.server.process import SERVER_ENV, server_command


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m lit_offpolicy.rollout.server.serve",
        description="a vLLM server for lit-offpolicy's vllm_server engine; other options go to vLLM",
    )
    parser.add_argument("--model", required=True, help="a local Hugging Face model directory")
    parser.add_argument("--host", default="0.0.0.0", help="address to listen on (default: all)")
    parser.add_argument("--port", type=int, default=8000)
    known, vllm_options = parser.parse_known_args(argv)
    command = server_command(known.model, known.host, known.port, {}) + vllm_options
    print(" ".join(command), flush=True)
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)  # kept across exec
    os.execve(sys.executable, command, {**os.environ, **SERVER_ENV})


if __name__ == "__main__":
    main()
