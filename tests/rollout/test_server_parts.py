"""The rollout servers' parts that need no vLLM: the watchdog on real processes, the option and
version plumbing, the spec's checks. The engine itself: tests/integration/test_rollout_servers.py."""

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import psutil
import pytest
import torch

from lit_offpolicy.rollout import ENGINES, VLLMServerSpec
from lit_offpolicy.rollout.server import supervise
from lit_offpolicy.rollout.server.engine import cpu_binding, token_versions
from lit_offpolicy.rollout.server.process import server_arguments
from lit_offpolicy.rollout.server.supervise import GRACE_S
from lit_offpolicy.rollout.weight_sync import buckets_of

# A stand-in for `vllm serve` (the part that matters here is real): a process that starts a child of its
# own, as the API server starts its engine core, writes both pids, and lives until killed.
FAKE_SERVER = textwrap.dedent(
    """
    import subprocess, sys, time
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    with open(sys.argv[1], "w") as f:
        f.write(f"{__import__('os').getpid()} {child.pid}")
    time.sleep(600)
    """
)
# The trainer: starts the watchdog (argv[4]) with the fake server, then waits to be killed.
TRAINER = textwrap.dedent(
    """
    import subprocess, sys, time
    server = [sys.executable, "-c", sys.argv[1], sys.argv[2]]
    watchdog = subprocess.Popen([sys.executable, sys.argv[4], "--", *server])
    with open(sys.argv[3], "w") as f:
        f.write(str(watchdog.pid))
    time.sleep(600)
    """
)


def _wait_for(path, timeout=30.0) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists() and path.read_text():
            return path.read_text()
        time.sleep(0.05)
    raise AssertionError(f"{path} was not written")


@pytest.fixture
def trainer_with_server(tmp_path):
    pids_file, watchdog_file = tmp_path / "server.pids", tmp_path / "watchdog.pid"
    arguments = [FAKE_SERVER, str(pids_file), str(watchdog_file), supervise.__file__]
    trainer = subprocess.Popen([sys.executable, "-c", TRAINER, *arguments])
    server, engine_core = map(int, _wait_for(pids_file).split())
    watchdog = int(_wait_for(watchdog_file))
    yield trainer, [psutil.Process(pid) for pid in (watchdog, server, engine_core)]
    trainer.kill()
    trainer.wait()


def _all_end(processes, timeout=GRACE_S + 5) -> None:
    """Each process ends (a zombie has: its parent here may be asleep, or an init that does not reap)."""
    deadline = time.monotonic() + timeout
    while running := [p for p in processes if _running(p)]:
        assert time.monotonic() < deadline, f"left running: {[(p.pid, p.cmdline()) for p in running]}"
        time.sleep(0.1)


def _running(process: psutil.Process) -> bool:
    try:
        return process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


@pytest.mark.slow  # real processes, no floats: not part of test-numerics
def test_the_server_and_its_child_end_when_the_trainer_is_sigkilled(trainer_with_server):
    trainer, processes = trainer_with_server
    trainer.kill()
    trainer.wait()
    _all_end(processes)


@pytest.mark.slow  # real processes, no floats: not part of test-numerics
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_to_the_watchdog_ends_the_whole_server_group(trainer_with_server, sig):
    _, (watchdog, server, engine_core) = trainer_with_server
    watchdog.send_signal(sig)
    _all_end([watchdog, server, engine_core])


@pytest.mark.slow  # real processes, no floats: not part of test-numerics
def test_a_sigkilled_server_does_not_leave_its_child_behind(trainer_with_server):
    """vLLM's engine core outlives a SIGKILLed API server on its own; the watchdog ends it."""
    _, (watchdog, server, engine_core) = trainer_with_server
    server.kill()
    _all_end([watchdog, engine_core])


def test_server_arguments():
    options = {"max_model_len": 128, "enforce_eager": True, "trust_remote_code": False, "seed": None}
    options["weight_transfer_config"] = {"backend": "x"}
    assert server_arguments(options) == [
        "--max-model-len", "128", "--enforce-eager", "--weight-transfer-config", json.dumps({"backend": "x"}),
    ]  # fmt: skip


def test_token_versions_from_vllm_spans():
    spans = [{"version": "3", "start": 0, "end": 2}, {"version": "4", "start": 2, "end": 5}]
    assert token_versions(spans, 5) == [3, 3, 4, 4, 4]
    assert token_versions([], 0) == []
    with pytest.raises(RuntimeError, match="no weight version for some sampled tokens"):
        token_versions(spans[:1], 5)
    with pytest.raises(RuntimeError, match="labels its weights 'default': they were not pushed by this run"):
        token_versions([{"version": "default", "start": 0, "end": 1}], 1)


def test_cpu_binding_gives_each_server_its_own_cores(monkeypatch):
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    assert [cpu_binding(i, 2) for i in range(2)] == [
        {"VLLM_CPU_OMP_THREADS_BIND": "0,1"},
        {"VLLM_CPU_OMP_THREADS_BIND": "2,3"},
    ]
    assert [cpu_binding(i, 3) for i in range(3)] == [
        {"VLLM_CPU_OMP_THREADS_BIND": "0"},
        {"VLLM_CPU_OMP_THREADS_BIND": "1"},
        {"VLLM_CPU_OMP_THREADS_BIND": "2,3"},
    ]
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    assert [cpu_binding(i, 3)["VLLM_CPU_OMP_THREADS_BIND"] for i in range(3)] == ["0", "1", "0"]
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0-1")
    assert cpu_binding(0, 2) == {}  # the user's choice stands


def test_buckets_of_regroups_a_stream_by_bytes():
    pairs = [("a", torch.zeros(4)), ("b", torch.zeros(4)), ("c", torch.zeros(16)), ("d", torch.zeros(1))]
    buckets = list(buckets_of(iter(pairs), bucket_bytes=32))  # float32: 16, 16, 64, 4 bytes
    assert [[name for name, _ in bucket] for bucket in buckets] == [["a", "b"], ["c"], ["d"]]


def test_the_spec_is_registered_and_checks_its_options(tmp_path):
    assert ENGINES.get("vllm_server") is VLLMServerSpec
    with pytest.raises(ValueError, match="exactly one of urls .* and launch"):
        VLLMServerSpec()
    with pytest.raises(ValueError, match="exactly one of urls .* and launch"):
        VLLMServerSpec(urls=["http://127.0.0.1:8000"], launch={"servers": 1})
    with pytest.raises(ValueError, match="urls: 'localhost' is not http://host:port"):
        VLLMServerSpec(urls=["localhost"])
    with pytest.raises(ValueError, match="launch.servers=0"):
        VLLMServerSpec(launch={"servers": 0})
    with pytest.raises(ValueError, match="launch.logprobs_mode: the engine needs 'processed_logprobs'"):
        VLLMServerSpec(launch={"logprobs_mode": "raw_logprobs"})
    with pytest.raises(ValueError, match="request_timeout_s=0"):
        VLLMServerSpec(launch={}, request_timeout_s=0)
