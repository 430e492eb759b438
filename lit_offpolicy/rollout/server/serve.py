"""Start one rollout server by hand (or from a SLURM script) for ``VLLMServerSpec(urls=[...])``:

    python -m lit_offpolicy.rollout.server.serve --model DIR --port 8000 [vllm serve options...]

It becomes (``exec``) vLLM's own OpenAI-compatible server with the options the rollout engine needs
(``process.REQUIRED_OPTIONS``) and its RL routes mounted; every other option is vLLM's, passed on
as given (on a CPU: ``--dtype float32``). lit-offpolicy must be installed beside vLLM: its weight
transfer backend is a vLLM plugin.

SIGUSR1 is ignored: it is SLURM's warning before a preemption or the time limit (``--signal=USR1@90``),
sent to every step of the job; the trainer saves and requeues the job on it, and needs the servers to
finish its step. The requeue ends them, and the requeued job starts them again.

The mistakes a reader makes at the first try are refused in one line before vLLM starts (its own
errors are tracebacks): a model directory that is not one, a ``--max-model-len`` beyond the model's
positions, a port something already listens on.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import socket
import sys

from lit_offpolicy.models.loading import require_model_dir
from lit_offpolicy.rollout.server.process import SERVER_ENV, server_command
from lit_offpolicy.rollout.vllm_engine import check_positions


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m lit_offpolicy.rollout.server.serve",
        description="a vLLM server for lit-offpolicy's vllm_server engine; other options go to vLLM",
    )
    parser.add_argument("--model", required=True, help="a local Hugging Face model directory")
    parser.add_argument("--host", default="0.0.0.0", help="address to listen on (default: all)")
    parser.add_argument("--port", type=int, default=8000)
    known, vllm_options = parser.parse_known_args(argv)
    try:
        check_before_start(known.model, known.host, known.port, vllm_options)
    except (OSError, ValueError) as error:
        sys.exit(f"{parser.prog}: error: {error}")
    command = server_command(known.model, known.host, known.port, {}) + vllm_options
    print(" ".join(command), flush=True)
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)  # kept across exec
    os.execve(sys.executable, command, {**os.environ, **SERVER_ENV})


def check_before_start(model: str, host: str, port: int, vllm_options: list[str]) -> None:
    """Refuse, in one line, a model that is not a local model directory, a ``--max-model-len`` over
    its ``max_position_embeddings`` and a port in use (vLLM would fail on each after loading)."""
    path = require_model_dir(model, "--model")
    lengths = argparse.ArgumentParser(add_help=False)
    lengths.add_argument("--max-model-len", "--max_model_len", dest="max_model_len")
    given = tokens_of(lengths.parse_known_args(vllm_options)[0].max_model_len)
    if given is not None:
        check_positions(given, path)
    if not 0 <= port <= 65535:
        raise ValueError(f"--port {port}: a TCP port is 0 to 65535 (default 8000)")
    with socket.socket() as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds: TIME_WAIT is free
        try:
            probe.bind((host, port))
        except OSError as error:
            raise OSError(
                f"--port {port}: cannot listen on {host}:{port} ({error.strerror}); another "
                "server may run there: stop it or choose another --port"
            ) from None


def tokens_of(max_model_len: str | None) -> int | None:
    """``--max-model-len`` as vLLM reads it: ``4096``, ``4k`` (4,000), ``4K`` (4,096), ``25.6k``; None for
    ``auto``, -1 and what vLLM itself will refuse."""
    match = re.fullmatch(r"(\d+(?:\.\d+)?)([kmgt]?)", (max_model_len or "").strip(), flags=re.IGNORECASE)
    if match is None:
        return None
    number, suffix = match.groups()
    power = "kmgt".index(suffix.lower()) + 1 if suffix else 0
    if suffix.isupper():
        return int(number) * 2 ** (10 * power) if number.isdigit() else None
    return int(float(number) * 10 ** (3 * power))


if __name__ == "__main__":
    main()
