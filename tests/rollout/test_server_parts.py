"""The rollout servers' parts that need no vLLM: the watchdog on real processes, the option and
version plumbing, the spec's checks. The engine itself: tests/integration/test_rollout_servers.py."""

import contextlib
import http.server
import json
import os
import signal
import socket
import struct
import subprocess
import sys
import textwrap
import threading
import time

import psutil
import pytest
import torch

from lit_offpolicy.rollout import ENGINES, ServerError, ServersLostError, VLLMServerSpec
from lit_offpolicy.rollout.server import client as client_module
from lit_offpolicy.rollout.server import pool as pool_module
from lit_offpolicy.rollout.server import process as process_module
from lit_offpolicy.rollout.server import supervise
from lit_offpolicy.rollout.server.client import ServerClient
from lit_offpolicy.rollout.server.engine import GENERATE_ROUTE, cpu_binding, token_versions, unfinished
from lit_offpolicy.rollout.server.pool import FAILED_TRIES, Server, ServerPool
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
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP])
def test_a_signal_to_the_watchdog_ends_the_whole_server_group(trainer_with_server, sig):
    _, (watchdog, server, engine_core) = trainer_with_server
    watchdog.send_signal(sig)
    _all_end([watchdog, server, engine_core])


@pytest.mark.slow  # real processes, no floats: not part of test-numerics
def test_ctrl_c_leaves_the_server_to_the_trainer(trainer_with_server):
    """Ctrl-C reaches the run's whole process group, the watchdogs with it: the server must live
    until the trainer has finished its step on it and stops it (or exits, killed)."""
    trainer, (watchdog, server, engine_core) = trainer_with_server
    watchdog.send_signal(signal.SIGINT)
    time.sleep(1.0)  # the watchdog polls every 0.2 s
    assert all(_running(p) for p in (watchdog, server, engine_core))
    trainer.kill()
    _all_end([watchdog, server, engine_core])


@pytest.mark.slow  # real processes, no floats: not part of test-numerics
def test_a_stopped_server_still_ends_with_its_group(trainer_with_server):
    """A server that stops answering (SIGSTOPped, hung): SIGTERM is taken at once, not after the grace."""
    _, (watchdog, server, engine_core) = trainer_with_server
    server.suspend()
    engine_core.suspend()
    started = time.monotonic()
    watchdog.terminate()
    _all_end([watchdog, server, engine_core])
    assert time.monotonic() - started < GRACE_S


@pytest.mark.slow  # real processes, no floats: not part of test-numerics
def test_a_sigkilled_server_does_not_leave_its_child_behind(trainer_with_server):
    """vLLM's engine core outlives a SIGKILLed API server on its own; the watchdog ends it."""
    _, (watchdog, server, engine_core) = trainer_with_server
    server.kill()
    _all_end([watchdog, engine_core])


# A stand-in for a busy `vllm serve` that does not act on SIGTERM (the part that matters here is real):
# it answers /health on argv[1], starts a child that ignores SIGTERM too, and writes both pids to argv[2].
STUBBORN_SERVER = textwrap.dedent(
    """
    import http.server, signal, subprocess, sys
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    class Health(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.end_headers()
    server = http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), Health)
    with open(sys.argv[2], "w") as f:
        f.write(f"{__import__('os').getpid()} {child.pid}")
    server.serve_forever()
    """
)


@pytest.mark.slow  # real processes, no floats: not part of test-numerics
def test_stopping_a_server_whose_watchdog_was_killed_ends_its_whole_group(tmp_path, monkeypatch):
    """The watchdog SIGKILLed (an OOM kill, a user's kill -9): its server got only SIGTERM, which a busy
    server may not act on. Stopping the server, as the run does when it loses it or ends, ends it and
    its child all the same."""
    pids_file = tmp_path / "server.pids"
    monkeypatch.setattr(
        process_module,
        "server_command",
        lambda model_path, host, port, options: [
            sys.executable,
            "-c",
            STUBBORN_SERVER,
            str(port),
            str(pids_file),
        ],
    )
    launched = process_module.LaunchedServer("unused", {}, tmp_path / "server.log", {}, "127.0.0.1")
    launched.wait_healthy(ServerClient(launched.url, timeout_s=5.0), timeout_s=30.0)
    server, child = (psutil.Process(int(pid)) for pid in _wait_for(pids_file).split())
    try:
        launched.process.kill()
        launched.process.wait()
        time.sleep(1.0)
        assert _running(server) and _running(child), "the stand-in should ignore its SIGTERM"
        launched.stop()
        _all_end([server, child], timeout=5.0)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(server.pid, signal.SIGKILL)


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


# ----------------------------------------------------------------- the pool's decisions, on real HTTP servers


class FakeServer:
    """A real HTTP server on loopback that plays a vLLM server's failures: ``generate`` is what its
    generate route does ("stop", "abort", "500", "400", "reset", "hang", "keep-alive-close": the second
    request on a kept-alive connection is dropped unread, as a server closing the connection at its idle
    limit does), ``health`` what ``/health`` does ("ok", "500", "hang"). Its requests are counted."""

    def __init__(self, generate: str = "stop", health: str = "ok") -> None:
        self.generate, self.health, self.requests = generate, health, 0
        owner = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1" if generate == "keep-alive-close" else "HTTP/1.0"
            answered = 0  # on this connection (one handler per connection)

            def log_message(self, *args) -> None:
                pass

            def do_GET(self) -> None:
                if not self._dropped_as_reused():
                    self._act(owner.health)

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

            def _act(self, behaviour: str) -> None:
                if behaviour == "hang":
                    time.sleep(30)
                    return
                if behaviour == "reset":
                    self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                    self.close_connection = True
                    return
                status = int(behaviour) if behaviour.isdigit() else 200
                reason = behaviour if behaviour in ("stop", "abort") else "stop"
                body = json.dumps({"choices": [{"index": 0, "finish_reason": reason}]}).encode()
                self.send_response(status)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, args=(0.05,), daemon=True).start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


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
    with pytest.raises(ServersLostError, match="all 2 rollout servers are lost"):
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


def test_serve_ignores_slurms_warning_before_a_preemption(monkeypatch):
    """SLURM's ``--signal=USR1@90`` reaches every step of the job: a server started by ``serve`` must live
    through it to finish the trainer's step (the disposition is kept across exec)."""
    from lit_offpolicy.rollout.server import serve

    started = []
    monkeypatch.setattr(serve.os, "execve", lambda path, command, env: started.append(command))
    monkeypatch.setattr(signal, "signal", lambda sig, handler: started.append((sig, handler)))
    serve.main(["--model", "/models/m", "--port", "8123"])
    assert (signal.SIGUSR1, signal.SIG_IGN) in started
    assert "--port" in started[-1] and "8123" in started[-1]
