"""The rollout servers' parts that need no vLLM: the watchdog on real processes, the option and
version plumbing, the spec's checks. The engine itself: tests/integration/test_rollout_servers.py."""

import contextlib
import http.server
import itertools
import json
import multiprocessing
import os
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from pathlib import Path

import psutil
import pytest
import torch
from helpers.loopback import serve, stop
from helpers.shm import ShmServer, segment_holders, segment_holders_after

from lit_offpolicy.core import run_signal
from lit_offpolicy.rollout import ENGINES, ServerError, ServersLostError, VLLMServerSpec
from lit_offpolicy.rollout.server import client as client_module
from lit_offpolicy.rollout.server import pool as pool_module
from lit_offpolicy.rollout.server import process as process_module
from lit_offpolicy.rollout.server import supervise
from lit_offpolicy.rollout.server.client import ServerClient, ServerUnreachable
from lit_offpolicy.rollout.server.engine import (
    GENERATE_ROUTE,
    VLLMServerEngine,
    cpu_binding,
    token_versions,
    unfinished,
)
from lit_offpolicy.rollout.server.pool import FAILED_TRIES, Server, ServerPool
from lit_offpolicy.rollout.server.process import server_arguments
from lit_offpolicy.rollout.server.shm_sender import ShmSegment, ShmWeightSender
from lit_offpolicy.rollout.server.supervise import GRACE_S
from lit_offpolicy.rollout.server.transfer import on_this_host
from lit_offpolicy.rollout.weight_sync import buckets_of

# A stand-in for `vllm serve` (the part that matters here is real): a process that starts a child of its
# own, as the API server starts its engine core, leaves a file where vLLM leaves its RPC sockets
# (VLLM_RPC_BASE_PATH), writes both pids and that directory, and lives until killed.
FAKE_SERVER = textwrap.dedent(
    """
    import os, subprocess, sys, time
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    open(os.path.join(os.environ["VLLM_RPC_BASE_PATH"], "rpc-socket"), "w").close()
    with open(sys.argv[1], "w") as f:
        f.write(f"{os.getpid()} {child.pid} {os.environ['VLLM_RPC_BASE_PATH']}")
    time.sleep(600)
    """
)
# The same, deaf to SIGTERM (a vLLM server waiting on a request of its dead trainer), its child too.
DEAF_SERVER = "import signal; signal.signal(signal.SIGTERM, signal.SIG_IGN)\n" + FAKE_SERVER
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


def _server_written(path) -> tuple[psutil.Process, psutil.Process, Path]:
    """The stand-in server, its child and its RPC sockets' directory (one of its own, not the machine's)."""
    server, child, scratch = _wait_for(path).split()
    assert Path(scratch, "rpc-socket").is_file() and Path(scratch) != Path(tempfile.gettempdir())
    return psutil.Process(int(server)), psutil.Process(int(child)), Path(scratch)


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
    try:  # the trainer killed even where the set-up fails: its watchdog then ends the server
        server, engine_core, scratch = _server_written(pids_file)
        watchdog = psutil.Process(int(_wait_for(watchdog_file)))
        yield trainer, [watchdog, server, engine_core], scratch
    finally:
        trainer.kill()
        trainer.wait()


def _all_end(processes, scratch: Path | None = None, timeout=GRACE_S + 5) -> None:
    """Each process ends (a zombie has: its parent here may be asleep, or an init that does not reap),
    and the server's RPC sockets' directory, where given, is removed."""
    deadline = time.monotonic() + timeout
    while running := [p for p in processes if _running(p)]:
        assert time.monotonic() < deadline, f"left running: {[(p.pid, p.cmdline()) for p in running]}"
        time.sleep(0.1)
    while scratch is not None and scratch.exists():
        assert time.monotonic() < deadline + 5, (
            f"the server's RPC sockets were left: {list(scratch.iterdir())}"
        )
        time.sleep(0.1)


def _running(process: psutil.Process) -> bool:
    try:
        return process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


@pytest.mark.slow  # real processes, no floats: not part of test-numerics
def test_the_server_and_its_child_end_when_the_trainer_is_sigkilled(trainer_with_server):
    trainer, processes, scratch = trainer_with_server
    trainer.kill()
    trainer.wait()
    _all_end(processes, scratch)


@pytest.mark.slow  # real processes, no floats: not part of test-numerics
def test_a_server_deaf_to_sigterm_ends_when_the_run_group_with_its_watchdog_is_sigkilled(tmp_path):
    """``kill -9`` of the run's process group, the trainer and its watchdogs at once (the server has a
    session of its own): the server's parent-death SIGTERM does not end one that does not act on it;
    the watchdog's guard, out of the group, ends the server's group."""
    pids_file, watchdog_file = tmp_path / "server.pids", tmp_path / "watchdog.pid"
    arguments = [DEAF_SERVER, str(pids_file), str(watchdog_file), supervise.__file__]
    trainer = subprocess.Popen([sys.executable, "-c", TRAINER, *arguments], start_new_session=True)
    server, child, scratch = _server_written(pids_file)
    watchdog = psutil.Process(int(_wait_for(watchdog_file)))
    (watch,) = [p for p in watchdog.children() if p.pid != server.pid]
    try:
        os.killpg(trainer.pid, signal.SIGKILL)
        trainer.wait()
        _all_end([watchdog, server, child, watch], scratch)
    finally:
        for process in (server, child):
            with contextlib.suppress(psutil.NoSuchProcess):
                process.kill()


@pytest.mark.slow  # real processes, no floats: not part of test-numerics
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP])
def test_a_signal_to_the_watchdog_ends_the_whole_server_group(trainer_with_server, sig):
    _, processes, scratch = trainer_with_server
    processes[0].send_signal(sig)
    _all_end(processes, scratch)


@pytest.mark.slow  # real processes, no floats: not part of test-numerics
def test_ctrl_c_leaves_the_server_to_the_trainer(trainer_with_server):
    """Ctrl-C reaches the run's whole process group, the watchdogs with it: the server must live
    until the trainer has finished its step on it and stops it (or exits, killed)."""
    trainer, processes, scratch = trainer_with_server
    processes[0].send_signal(signal.SIGINT)
    time.sleep(1.0)  # the watchdog polls every 0.2 s
    assert all(_running(p) for p in processes) and scratch.is_dir()
    trainer.kill()
    _all_end(processes, scratch)


@pytest.mark.slow  # real processes, no floats: not part of test-numerics
def test_a_stopped_server_still_ends_with_its_group(trainer_with_server):
    """A server that stops answering (SIGSTOPped, hung): SIGTERM is taken at once, not after the grace."""
    _, (watchdog, server, engine_core), scratch = trainer_with_server
    server.suspend()
    engine_core.suspend()
    started = time.monotonic()
    watchdog.terminate()
    _all_end([watchdog, server, engine_core], scratch)
    assert time.monotonic() - started < GRACE_S


@pytest.mark.slow  # real processes, no floats: not part of test-numerics
def test_a_sigkilled_server_does_not_leave_its_child_behind(trainer_with_server):
    """vLLM's engine core outlives a SIGKILLed API server on its own; the watchdog ends it."""
    _, (watchdog, server, engine_core), scratch = trainer_with_server
    server.kill()
    _all_end([watchdog, engine_core], scratch)


# A stand-in for a busy `vllm serve` that does not act on SIGTERM (the part that matters here is real):
# it answers /health on argv[1], starts a child that ignores SIGTERM too, and writes both pids to argv[2].
STUBBORN_SERVER = textwrap.dedent(
    """
    import http.server, os, signal, subprocess, sys
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    open(os.path.join(os.environ["VLLM_RPC_BASE_PATH"], "rpc-socket"), "w").close()
    class Health(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.end_headers()
    server = http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), Health)
    with open(sys.argv[2], "w") as f:
        f.write(f"{os.getpid()} {child.pid} {os.environ['VLLM_RPC_BASE_PATH']}")
    server.serve_forever()
    """
)


@pytest.mark.slow  # real processes, no floats: not part of test-numerics
def test_stopping_a_server_whose_watchdog_was_killed_ends_its_whole_group(tmp_path, monkeypatch):
    """The watchdog SIGKILLed (an OOM kill, a user's kill -9): its server got only SIGTERM, which a busy
    server may not act on. Stopping the server, as the run does when it loses it or ends, ends it and
    its child all the same."""
    with _launched_stand_in(STUBBORN_SERVER, tmp_path, monkeypatch) as (launched, pids_file):
        server, child, scratch = _server_written(pids_file)
        launched.process.kill()
        launched.process.wait()
        time.sleep(1.0)
        assert _running(server) and _running(child), "the stand-in should ignore its SIGTERM"
        launched.stop()
        _all_end([server, child], scratch, timeout=5.0)


@contextlib.contextmanager
def _launched_stand_in(script: str, tmp_path, monkeypatch):
    """A ``LaunchedServer`` (the real watchdog) of ``python -c script PORT PIDS_FILE``, healthy; its group is
    SIGKILLed at the end, whatever the test left of it."""
    pids_file = tmp_path / "server.pids"
    monkeypatch.setattr(
        process_module,
        "server_command",
        lambda model_path, host, port, options: [sys.executable, "-c", script, str(port), str(pids_file)],
    )
    launched = process_module.LaunchedServer("unused", {}, tmp_path / "server.log", {}, "127.0.0.1")
    try:
        launched.wait_healthy(ServerClient(launched.url, timeout_s=5.0), timeout_s=30.0)
        yield launched, pids_file
    finally:
        launched.kill()


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
    with pytest.raises(ValueError, match=r"give urls \(servers that run\) or launch"):
        VLLMServerSpec()
    with pytest.raises(
        ValueError, match="both urls and launch are set .* give the whole engine: --rollout.engine"
    ):
        VLLMServerSpec(urls=["http://127.0.0.1:8000"], launch={"servers": 1})
    with pytest.raises(
        ValueError, match="transfer='nccl' is not shipped .* allowed values: 'auto', 'shm', 'tcp'"
    ):
        VLLMServerSpec(launch={}, transfer="nccl")
    with pytest.raises(ValueError, match="urls: 'localhost' is not http://host:port"):
        VLLMServerSpec(urls=["localhost"])
    with pytest.raises(ValueError, match="launch.servers=0"):
        VLLMServerSpec(launch={"servers": 0})
    with pytest.raises(ValueError, match="launch.logprobs_mode: the engine needs 'processed_logprobs'"):
        VLLMServerSpec(launch={"logprobs_mode": "raw_logprobs"})
    with pytest.raises(ValueError, match="request_timeout_s=0"):
        VLLMServerSpec(launch={}, request_timeout_s=0)


# ----------------------------------------------------------------- the pool's decisions, on real HTTP servers


class FakeServer:
    """A real HTTP server on loopback that plays a vLLM server's failures: ``generate`` is what its
    generate route does ("stop", "abort", "500", "400", "reset", "hang", "keep-alive-close": the second
    request on a kept-alive connection is dropped unread, as a server closing the connection at its idle
    limit does), ``health`` what ``/health`` does ("ok", "500", "hang"), and ``/weight_info`` too, with
    ``version`` where it is "ok". Its requests are counted."""

    def __init__(self, generate: str = "stop", health: str = "ok") -> None:
        self.generate, self.health, self.requests = generate, health, 0
        self.version = 0
        owner = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1" if generate == "keep-alive-close" else "HTTP/1.0"
            answered = 0  # on this connection (one handler per connection)

            def log_message(self, *args) -> None:
                pass

            def do_GET(self) -> None:
                if not self._dropped_as_reused():
                    self._act(owner.health, {"weight_version": str(owner.version)})

            def do_POST(self) -> None:
                self.rfile.read(int(self.headers["Content-Length"]))
                if not self._dropped_as_reused():
                    owner.requests += 1
                    self._act(owner.generate)

            def _dropped_as_reused(self) -> bool:
                """With "keep-alive-close": close the connection, unanswered, at its second request."""
                self.answered += 1
                if owner.generate == "keep-alive-close" and self.answered > 1:
                    self.close_connection = True
                    return True
                return False

            def _act(self, behaviour: str, answer: dict | None = None) -> None:
                if behaviour == "hang":
                    time.sleep(30)
                    return
                if behaviour == "reset":
                    self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                    self.close_connection = True
                    return
                status = int(behaviour) if behaviour.isdigit() else 200
                reason = behaviour if behaviour in ("stop", "abort") else "stop"
                body = json.dumps(answer or {"choices": [{"index": 0, "finish_reason": reason}]}).encode()
                self.send_response(status)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        self.httpd, self.url = serve(Handler)

    def close(self) -> None:
        stop(self.httpd)


@pytest.fixture
def fake_servers():
    made = []

    def make(*behaviours: tuple[str, str]) -> list[FakeServer]:
        made.extend(FakeServer(*behaviour) for behaviour in behaviours)
        return made

    yield make
    for server in made:
        server.close()


def pool_of(servers: list[FakeServer], timeout_s: float = 20.0) -> ServerPool:
    return ServerPool([Server(ServerClient(server.url, timeout_s)) for server in servers])


def generate(pool: ServerPool) -> dict:
    return pool.request(GENERATE_ROUTE, {"token_ids": [1]}, cost=1, failure=unfinished)


@pytest.mark.slow  # real processes, no floats: not part of test-numerics
@pytest.mark.parametrize(
    "generate_does, health",
    [("abort", "500"), ("500", "500"), ("reset", "ok"), ("reset", "500"), ("abort", "hang")],
)
def test_a_failed_request_on_a_server_that_then_fails_its_health_goes_to_the_other(
    fake_servers, capfd, monkeypatch, generate_does, health
):
    """The engine core dead under a live API server (an ``abort`` answer, or a 5xx, then ``/health``
    failing or hanging), a connection reset: the server is lost, one warning, and the request is
    answered by the other server."""
    monkeypatch.setattr(pool_module, "HEALTH_TIMEOUT_S", 0.5)
    broken, good = fake_servers((generate_does, health), ("stop", "ok"))
    pool = pool_of([broken, good])
    pool.servers[1].outstanding = 1  # the broken server is the least loaded: it is asked first
    answer = generate(pool)
    assert answer["choices"][0]["finish_reason"] == "stop"
    tries = 2 if generate_does == "reset" else 1  # a reset connection is tried once more, on a new one
    assert (broken.requests, good.requests) == (tries, 1)
    assert [server.alive for server in pool.servers] == [False, True]
    assert capfd.readouterr().err.count(f"rollout server {broken.url} is lost") == 1
    pool.close()


def test_a_request_that_fails_on_healthy_servers_is_retried_then_named(fake_servers, capfd):
    """An ``abort`` from a server that still answers ``/health`` is no lost server: re-sent, up to
    FAILED_TRIES times in all, then one error naming the reason; no server is taken out."""
    servers = fake_servers(("abort", "ok"), ("abort", "ok"))
    pool = pool_of(servers)
    with pytest.raises(
        ServerError, match=f"failed {FAILED_TRIES} times on servers that still answer /health"
    ):
        generate(pool)
    assert sum(server.requests for server in servers) == FAILED_TRIES
    assert all(server.alive for server in pool.servers) and "is lost" not in capfd.readouterr().err
    servers[0].generate = "stop"
    assert generate(pool)["choices"][0]["finish_reason"] == "stop"  # one abort, then an answer
    pool.close()


def test_a_rank_that_does_not_push_goes_on_once_the_servers_serve_the_version_it_was_handed(fake_servers):
    """Rank 1 of 2 is handed version 4 while rank 0 pushes it: it waits until every live server serves
    it (``/weight_info``), so that its next requests sample those weights (an async producer would
    start its batch on the old ones, which the staleness bound then drops); a server that does not
    answer is not waited for."""
    pushed, silent = fake_servers(("stop", "ok"), ("stop", "500"))
    pushed.version = 3
    engine = VLLMServerEngine(pool_of([pushed, silent]), max_model_len=64, ranks=2, rank=1)
    threading.Timer(0.5, lambda: setattr(pushed, "version", 4)).start()
    started = time.monotonic()
    engine.load_weights({}, 4)
    assert time.monotonic() - started >= 0.5 and engine.policy_version == 4
    engine.close()


def test_a_kept_alive_connection_the_server_closes_as_it_is_reused_loses_no_server(fake_servers, capfd):
    """A server closes an idle kept-alive connection after its limit (uvicorn's 5 s); a request sent on
    it at that moment is dropped unread (seen in an async run: both servers lost, 1 in ~10 runs). The
    client sends it once more on a new connection: answered, no server lost."""
    (server,) = fake_servers(("keep-alive-close", "ok"))
    pool = pool_of([server])
    for _ in range(3):
        assert generate(pool)["choices"][0]["finish_reason"] == "stop"
        assert pool.servers[0].client.healthy()  # the health check, on a kept-alive connection too
    assert server.requests == 3 and pool.servers[0].alive
    assert "is lost" not in capfd.readouterr().err
    pool.close()


@pytest.mark.slow  # real processes, no floats: not part of test-numerics
@pytest.mark.parametrize("signal_to", ["no run", "this run", "an earlier run"])
def test_a_launched_server_that_ends_after_a_signal_to_the_run_is_no_lost_server(
    tmp_path, monkeypatch, capfd, signal_to
):
    """SIGTERM to the run's process group reaches the launched servers' watchdogs, which end them while
    the step still samples: after the signal that is no loss to warn about, and the run's last line says
    the servers ended with the signal. Without a signal, or after one to an earlier run of the same
    process, the same end is a lost server, warned."""
    monkeypatch.setattr(
        process_module,
        "server_command",
        lambda model_path, host, port, options: [sys.executable, "-m", "http.server", str(port), "-b", host],
    )
    launched = process_module.LaunchedServer("unused", {}, tmp_path / "server.log", {}, "127.0.0.1")
    if signal_to == "an earlier run":
        run_signal.note()
    pool = ServerPool([Server(ServerClient(launched.url, 5.0), launched)])
    if signal_to == "this run":
        run_signal.note()  # what PreemptionCheckpoint does on the signal
    try:
        launched.stop()  # what its watchdog does on SIGTERM
        if signal_to == "this run":
            expected = rf"the 1 rollout servers it launched ended with the signal \({launched.url}\)"
        else:
            expected = rf"all 1 rollout servers are lost \({launched.url}\); see the warnings above"
        with pytest.raises(ServersLostError, match=expected):
            generate(pool)
        err = capfd.readouterr().err
        assert err.count("is lost") == (0 if signal_to == "this run" else 1)
        if signal_to != "this run":  # the reason as the system gives it, not cut off by requests' message
            assert "/inference/v1/generate: [Errno 111] Connection refused; its log: " in err, err
    finally:
        pool.close()


def test_a_bad_request_is_an_error_not_a_lost_server(fake_servers):
    servers = fake_servers(("400", "ok"), ("stop", "ok"))
    pool = pool_of(servers)
    with pytest.raises(ServerError, match="HTTP 400"):
        generate(pool)
    assert all(server.alive for server in pool.servers) and servers[1].requests == 0
    pool.close()


@pytest.mark.slow  # real processes, no floats: not part of test-numerics
def test_a_server_that_stops_answering_is_lost_by_the_monitor_before_the_request_time_limit(
    fake_servers, monkeypatch, capfd
):
    """A server that hangs (its request and its ``/health``): the monitor finds it within seconds and
    the request goes to the other, long before ``request_timeout_s`` (60 s here)."""
    monkeypatch.setattr(pool_module, "HEALTH_EVERY_S", 0.5)
    monkeypatch.setattr(pool_module, "HEALTH_TIMEOUT_S", 0.5)
    hung, good = fake_servers(("hang", "hang"), ("stop", "ok"))
    pool = pool_of([hung, good], timeout_s=60.0)
    pool.servers[1].outstanding = 1
    started = time.monotonic()
    assert generate(pool)["choices"][0]["finish_reason"] == "stop"
    assert time.monotonic() - started < 10
    assert [server.alive for server in pool.servers] == [False, True] and good.requests == 1
    assert "it stopped answering /health" in capfd.readouterr().err
    pool.close()


@pytest.mark.slow  # real processes, no floats: not part of test-numerics
def test_a_weight_push_skips_a_server_that_stops_answering(fake_servers, monkeypatch, capfd):
    """An API server whose engine core died held ``/pause`` open until the time limit (120 s, seen on
    vLLM): the monitor loses it within seconds and the push goes on with the others."""
    monkeypatch.setattr(pool_module, "HEALTH_EVERY_S", 0.5)
    monkeypatch.setattr(pool_module, "HEALTH_TIMEOUT_S", 0.5)
    hung, good = fake_servers(("hang", "hang"), ("stop", "ok"))
    pool = pool_of([hung, good], timeout_s=60.0)
    started = time.monotonic()
    pool.for_each(lambda server: server.client.post("/pause"))
    assert time.monotonic() - started < 10
    assert [server.alive for server in pool.servers] == [False, True] and good.requests == 1
    assert capfd.readouterr().err.count("is lost") == 1
    pool.close()


def test_no_server_left_is_servers_lost_and_closing_reports_no_loss(fake_servers, capfd):
    servers = fake_servers(("reset", "500"), ("reset", "500"))
    pool = pool_of(servers)
    with pytest.raises(
        ServersLostError, match=r"all 2 rollout servers are lost \(http://127.0.0.1:\d+, http"
    ):
        generate(pool)
    capfd.readouterr()
    quiet = pool_of(fake_servers(("stop", "ok")))
    quiet.close()
    quiet.lose(quiet.servers[0], ServerError("stopped by the run"))  # a server that ends with the run
    assert "is lost" not in capfd.readouterr().err


@pytest.mark.slow  # real processes, no floats: not part of test-numerics
def test_the_wait_for_a_server_s_health_is_reported(fake_servers, monkeypatch, capsys):
    monkeypatch.setattr(client_module, "WAIT_NOTE_EVERY_S", 0.4)
    (server,) = fake_servers(("stop", "500"))
    threading.Timer(1.2, lambda: setattr(server, "health", "ok")).start()
    assert ServerClient(server.url, 5.0).wait_healthy(timeout_s=10)
    notes = [line for line in capsys.readouterr().out.splitlines() if "waiting for rollout server" in line]
    first = f"lit-offpolicy: waiting for rollout server {server.url} to answer /health: 0 s of "
    assert notes[0] == first + "startup_timeout_s=10"
    assert len(notes) >= 2 and notes[-1].endswith(" s of startup_timeout_s=10") and notes[-1] != notes[0]


def test_serve_ignores_slurms_warning_before_a_preemption(monkeypatch, tiny_model_dir):
    """SLURM's ``--signal=USR1@90`` reaches every step of the job: a server started by ``serve`` must live
    through it to finish the trainer's step (the disposition is kept across exec)."""
    from lit_offpolicy.rollout.server import serve

    started = []
    monkeypatch.setattr(serve.os, "execve", lambda path, command, env: started.append(command))
    monkeypatch.setattr(signal, "signal", lambda sig, handler: started.append((sig, handler)))
    port = process_module.free_port()
    serve.main(["--model", tiny_model_dir, "--port", str(port), "--max-model-len", "128"])
    assert (signal.SIGUSR1, signal.SIG_IGN) in started
    assert "--port" in started[-1] and str(port) in started[-1] and "128" in started[-1]


def test_serve_refuses_a_first_try_mistake_in_one_line_before_vllm_starts(
    monkeypatch, capsys, tiny_model_dir
):
    """docs/rollout_servers.md's example once asked 4096 positions of the tiny model's 128: vLLM died in a
    58-line traceback after loading. Each such mistake is one line naming the option; nothing is exec'd."""
    from lit_offpolicy.rollout.server import serve

    monkeypatch.setattr(serve.os, "execve", lambda *args: pytest.fail("vLLM started"))
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        busy = taken.getsockname()[1]
        cases = {
            ("--model", "/no/such/model"): "--model: model directory /no/such/model does not exist",
            ("--model", tiny_model_dir, "--max-model-len", "4096"): (
                "max_model_len=4096 is more than the model's max_position_embeddings=128"
            ),
            ("--model", tiny_model_dir, "--max_model_len=129"): "max_position_embeddings=128",
            (
                "--model",
                tiny_model_dir,
                "--max-model-len",
                "4k",
            ): "max_model_len=4000 is more than",  # vLLM's k
            (
                "--model",
                f"{tiny_model_dir}/config.json",
            ): f"--model: {tiny_model_dir}/config.json is a file; pass",
            ("--model", tiny_model_dir, "--port", "80000"): "--port 80000: a TCP port is 0 to 65535",
            ("--model", tiny_model_dir, "--host", "127.0.0.1", "--port", str(busy)): (
                f"--port {busy}: cannot listen on 127.0.0.1:{busy} (Address already in use)"
            ),
        }
        for argv, message in cases.items():
            with pytest.raises(SystemExit) as exit:
                serve.main([*argv, "--dtype", "float32"])
            assert exit.value.code.startswith("python -m lit_offpolicy.rollout.server.serve: error: ")
            assert message in exit.value.code and "\n" not in exit.value.code
    assert capsys.readouterr().out == ""


# ----------------------------------------------------------------- the shared-memory weight transfer

FORK = multiprocessing.get_context("fork")  # the test's imports are there at once (a fresh process: 5 s)


def _push_until_killed(url: str, progress: str) -> None:
    """The trainer side in a process of its own: one bucket after another, counted in ``progress``.
    Tensors below torch's parallel grain: no OpenMP in a forked child."""
    sender = ShmWeightSender(ServerClient(url, 30.0), ShmSegment(), 30.0)
    for step in itertools.count(1):
        sender.send_bucket([(f"w{i}", torch.full((2**14,), float(step))) for i in range(16)])
        with open(progress, "w") as file:
            file.write(str(step))


def _serve(news, hang_at: int) -> None:
    """A ``ShmServer`` in a process of its own, until killed: its URL, then "hanging" at ``hang_at``."""
    news.send(ShmServer(hang_at, on_hang=lambda: news.send("hanging")).url)
    time.sleep(600)


@pytest.fixture
def shm_servers():
    made = []

    def make(count: int = 1, hang_at: int = 0) -> list[ShmServer]:
        made.extend(ShmServer(hang_at) for _ in range(count))
        return made[-count:]

    yield make
    for server in made:
        server.close()


def test_a_bucket_is_written_once_for_every_local_server_and_arrives_bit_for_bit(shm_servers, monkeypatch):
    servers = shm_servers(2)
    segment = ShmSegment()
    senders = [ShmWeightSender(ServerClient(server.url, 10.0), segment, 10.0) for server in servers]
    writes = []
    write = segment._write
    monkeypatch.setattr(segment, "_write", lambda bucket: writes.append(bucket) or write(bucket))
    generator = torch.Generator().manual_seed(0)
    buckets = [
        [
            ("a", torch.randn(3, 5, generator=generator)),
            ("b", torch.randn(7, generator=generator).bfloat16()),
        ],
        [("c", torch.randn(2**16, generator=generator))],  # larger than the first: the segment grows
    ]
    for bucket in buckets:
        for sender in senders:
            sender.send_bucket(bucket)
    assert len(writes) == len(buckets)  # once per bucket, not once per server
    for server in servers:
        assert os.fstat(server.reader.fd).st_ino == os.fstat(segment.fd).st_ino  # one segment for both
        for name, tensor in (pair for bucket in buckets for pair in bucket):
            received = server.received[name]
            assert received.dtype == tensor.dtype and torch.equal(
                received.view(torch.uint8), tensor.view(torch.uint8)
            )
    for sender in senders:
        sender.close()
    assert segment.fd == -1  # the last sender closed it
    assert not segment_holders_after([os.getpid()])  # nor do the servers, once they see it


@pytest.mark.slow  # real processes
def test_a_trainer_sigkilled_mid_push_leaves_no_segment(shm_servers, tmp_path):
    """The server's reader lets go of the segment as soon as the trainer's end of its socket closes:
    nothing in /dev/shm, no descriptor or mapping left in any process."""
    (server,) = shm_servers(1)
    progress = tmp_path / "pushed"
    trainer = FORK.Process(target=_push_until_killed, args=(server.url, str(progress)), daemon=True)
    trainer.start()
    try:
        deadline = time.monotonic() + 60
        while not (progress.exists() and progress.read_text() and int(progress.read_text()) >= 3):
            assert trainer.is_alive() and time.monotonic() < deadline, "the trainer pushed no bucket"
            time.sleep(0.01)
        assert segment_holders([os.getpid()]), "the server does not map the segment"
    finally:
        trainer.kill()
        trainer.join()
    assert not segment_holders_after([os.getpid()]), "the server holds the dead trainer's segment"
    assert server.reader.fd is None
    assert not [name for name in os.listdir("/dev/shm") if "lit-offpolicy" in name]


@pytest.mark.slow  # real processes
def test_a_server_sigkilled_mid_push_is_unreachable_and_its_trainer_closes_the_segment(tmp_path):
    """The server is SIGKILLed while it holds the second bucket's request: the trainer's send fails as
    an unreachable server (the pool loses it), and once the trainer closes, no process holds the segment."""
    news, sent = FORK.Pipe(duplex=False)
    server = FORK.Process(target=_serve, args=(sent, 2), daemon=True)
    server.start()
    try:
        assert news.poll(30), "the server did not start"
        url = news.recv()
        sender = ShmWeightSender(ServerClient(url, 30.0), ShmSegment(), 30.0)
        sender.send_bucket([("w", torch.ones(2**20))])
        assert segment_holders([server.pid]), "the server does not map the segment"
        errors: list[BaseException] = []
        push = threading.Thread(target=_recording(errors, sender.send_bucket, [("w", torch.zeros(2**20))]))
        push.start()
        assert news.poll(30) and news.recv() == "hanging", "the second bucket did not reach the server"
        server.kill()
        server.join()
        push.join(timeout=30)
        assert len(errors) == 1 and isinstance(errors[0], ServerUnreachable), errors
        sender.close()
    finally:
        server.kill()
    assert not segment_holders_after([os.getpid()])


def _recording(errors: list, call, *args):
    def run() -> None:
        try:
            call(*args)
        except BaseException as error:  # noqa: BLE001 - checked by the test
            errors.append(error)

    return run


def test_the_transfer_option_names_its_values_and_auto_finds_this_host(monkeypatch):
    with pytest.raises(
        ValueError, match=r"transfer='tcpip' is not supported; allowed values: 'auto', 'shm', 'tcp'"
    ):
        VLLMServerSpec(launch={}, transfer="tcpip")

    def given(url: str) -> Server:
        return Server(ServerClient(url, 1.0))

    assert on_this_host(given("http://127.0.0.1:8000")) and on_this_host(given("http://localhost:8000"))
    assert on_this_host(given(f"http://{socket.gethostname()}:8000"))
    assert not on_this_host(given("http://192.0.2.7:8000"))  # TEST-NET-1: no machine's own address
    assert not on_this_host(given("http://no-such-host.invalid:8000"))
    assert on_this_host(Server(ServerClient("http://192.0.2.7:8000", 1.0), launched=object()))


def test_a_server_that_cannot_take_the_shared_memory_is_one_error_naming_transfer_tcp(fake_servers):
    """A server that fails ``/init_weight_transfer_engine`` (its worker cannot reach the trainer's
    socket: another host, another network namespace) ends the start with one line naming the way out."""
    (server,) = fake_servers(("500", "ok"))
    segment = ShmSegment()
    with pytest.raises(
        ServerError, match=r"did not take the trainer's shared memory .*HTTP 500.* transfer: tcp"
    ):
        ShmWeightSender(ServerClient(server.url, 5.0), segment, 5.0)
    segment.close()


def test_a_view_of_the_segment_held_past_its_bucket_is_an_error_not_an_overwrite(shm_servers):
    """The server's worker loads a bucket from where it lies; whatever still holds a view of it when the
    bucket is done (the next one overwrites it) is named."""
    (server,) = shm_servers(1)
    sender = ShmWeightSender(ServerClient(server.url, 10.0), ShmSegment(), 10.0)
    sender.send_bucket([("w", torch.arange(8.0))])
    kept = []
    with (
        pytest.raises(RuntimeError, match="1 tensor.* still held after their bucket was loaded"),
        server.reader.views(["float32"], [[8]], [0]) as tensors,
    ):
        kept.append(tensors[0][2:])  # a view of a view
    assert torch.equal(kept[0], torch.arange(2.0, 8.0))
    kept.clear()
    sender.close()


# A stand-in for a vLLM server whose engine core and worker share memory (the part that matters here is
# real: Python's SharedMemory, which registers with the resource tracker the process starts in its group):
# it answers /health on argv[1] and writes its pid and the segment's name to argv[2].
SHARING_SERVER = textwrap.dedent(
    """
    import http.server, os, sys
    from multiprocessing import shared_memory
    segment = shared_memory.SharedMemory(create=True, size=1 << 20)
    class Health(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.end_headers()
    server = http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), Health)
    with open(sys.argv[2], "w") as f:
        f.write(f"{os.getpid()} {segment.name}")
    server.serve_forever()
    """
)


@pytest.mark.slow  # real processes, no floats: not part of test-numerics
def test_a_lost_server_killed_at_once_leaves_no_shared_memory(tmp_path, monkeypatch):
    """Killing a lost server's group at once spares Python's resource tracker, which unlinks what the
    killed processes shared (vLLM's engine core and worker: 400 MiB of /dev/shm for the tiny model, left
    at every server lost before), then exits."""
    with _launched_stand_in(SHARING_SERVER, tmp_path, monkeypatch) as (launched, pids_file):
        pid, name = _wait_for(pids_file).split()
        server = psutil.Process(int(pid))
        group = [server, *server.children(recursive=True)]
        assert Path("/dev/shm", name).exists() and len(group) == 2  # the server and its resource tracker
        launched.kill()
        _all_end(group, timeout=GRACE_S)
        assert not Path("/dev/shm", name).exists(), "the killed server's shared memory was left in /dev/shm"


def test_without_proc_a_group_is_killed_whole(monkeypatch):
    """Where there is no /proc to tell the resource tracker apart (not Linux), the group's SIGKILL is the
    former one: every process of it."""
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
    monkeypatch.setattr(supervise.os.path, "isdir", lambda path: False)
    supervise.kill_group(sleeper.pid)
    assert sleeper.wait(timeout=10) == -signal.SIGKILL
