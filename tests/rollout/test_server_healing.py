"""Lost rollout servers come back (``rollout.server.healing``): a launched one is started again on its
port, a given URL rejoins once it answers, each only after a weight push brought it to the run's
version; a server whose starts keep failing is left out with one line; nothing outlives the pool.

Real processes and real loopback HTTP: the launched servers are ``tests/helpers/fake_vllm_server.py``
under the real watchdog (a vLLM server's start costs 27 CPU-seconds; the real one comes back in
``tests/integration/test_rollout_servers_ranks.py``).
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from lit_offpolicy.core import run_signal
from lit_offpolicy.rollout.server import healing
from lit_offpolicy.rollout.server import process as process_module
from lit_offpolicy.rollout.server.client import ServerClient
from lit_offpolicy.rollout.server.engine import GENERATE_ROUTE, VLLMServerEngine, unfinished
from lit_offpolicy.rollout.server.pool import Server, ServerPool, ServersLostError
from lit_offpolicy.rollout.server.process import LaunchedServer, free_port, server_of

pytestmark = pytest.mark.slow  # real processes, no floats: not part of test-numerics

FAKE = Path(__file__).parents[1] / "helpers" / "fake_vllm_server.py"
DEADLINE_S = 60.0
"""Far above the seconds any wait here takes (a fake server starts in about 0.1 s)."""


@pytest.fixture
def launched(tmp_path, monkeypatch):
    """Two launched fake servers under their watchdogs, in a pool that heals (``max_restarts`` 2), in
    an engine; ``starts`` lists the routes each process was asked (``pid route version``)."""
    log = tmp_path / "routes.log"
    monkeypatch.setenv("FAKE_VLLM_LOG", str(log))
    monkeypatch.setattr(healing, "RESTART_DELAY_S", 0.1)
    monkeypatch.setattr(
        process_module,
        "server_command",
        lambda model_path, host, port, options: [
            sys.executable,
            str(FAKE),
            str(port),
            *options.get("argv", []),
        ],
    )
    servers = [LaunchedServer("unused", {}, tmp_path / f"server{i}.log", {}, "127.0.0.1") for i in range(2)]
    pool = ServerPool(
        [Server(ServerClient(server.url, 20.0), server) for server in servers],
        max_restarts=2,
        startup_timeout_s=20,
    )
    for server in pool.servers:
        server.launched.wait_healthy(server.client, 20)
    engine = VLLMServerEngine(pool, max_model_len=64)
    engine.routes = lambda: [line.split() for line in log.read_text().splitlines()] if log.exists() else []
    yield engine
    engine.close()


def generate(pool: ServerPool) -> dict:
    return pool.request(GENERATE_ROUTE, {"token_ids": [1]}, cost=1, failure=unfinished)


def kill_server(server: Server) -> int:
    """SIGKILL the server process under ``server``'s watchdog (an OOM kill); its pid."""
    process = server_of(psutil.Process(server.launched.process.pid))
    process.kill()
    return process.pid


def wait_until(condition, what: str) -> None:
    deadline = time.monotonic() + DEADLINE_S
    while not condition():
        assert time.monotonic() < deadline, f"not within {DEADLINE_S} s: {what}"
        time.sleep(0.05)


def test_a_killed_launched_server_starts_again_and_serves_only_after_a_push_brings_it_to_the_version(
    launched, capfd
):
    engine, pool = launched, launched.pool
    first, other = pool.servers
    pool.servers[1].outstanding = 1  # the killed server is the least loaded: asked first
    old_pid = kill_server(first)
    assert generate(pool)["choices"][0]["finish_reason"] == "stop"  # answered by the other
    assert engine.metrics() == {"rollout/servers_alive": 1.0, "rollout/server_restarts": 0.0}
    wait_until(lambda: first.ready, "the server answers again")
    new_pid = server_of(psutil.Process(first.launched.process.pid)).pid
    assert new_pid != old_pid and not psutil.pid_exists(old_pid)
    for _ in range(4):  # back, but not at the run's weights: no request reaches it
        generate(pool)
    assert not [route for pid, route, _ in engine.routes() if int(pid) == new_pid and route == GENERATE_ROUTE]

    engine.load_weights({}, 3)
    assert engine.metrics() == {"rollout/servers_alive": 2.0, "rollout/server_restarts": 1.0}
    other.outstanding = 10**6  # now the least loaded again
    generate(pool)
    asked = [(route, version) for pid, route, version in engine.routes() if int(pid) == new_pid]
    pushed = asked.index(("/finish_weight_update", "initial"))
    assert asked.index((GENERATE_ROUTE, "3")) > pushed, asked  # its first generation after the push
    assert asked[pushed - 3 : pushed] == [
        ("/v1/models", "initial"),
        ("/pause", "initial"),
        ("/start_weight_update", "initial"),
    ]
    err = capfd.readouterr().err
    assert err.count(f"rollout server {first.url} is lost") == 1
    assert f"; its log: {first.launched.log_file}); its requests go to the 1 server(s) left" in err
    assert f"rollout server {first.url} starts again (start 1 of max_restarts=2; lost: " in err
    assert f"rollout server {first.url} is back at version 3; 2 of 2 serve" in err
    assert len(err.strip().splitlines()) == 3, err


def test_a_server_killed_during_the_push_that_admits_it_is_lost_again_and_comes_back_later(launched, capfd):
    engine, pool = launched, launched.pool
    first = pool.servers[0]
    kill_server(first)
    engine.load_weights({}, 1)  # the push finds it gone
    wait_until(lambda: first.ready, "the server answers again")
    admit = pool.admit_ready
    pool.admit_ready = lambda: [kill_server(server) and server for server in admit()]
    engine.load_weights({}, 2)
    assert not first.alive and engine.metrics()["rollout/servers_alive"] == 1.0
    pool.admit_ready = admit
    wait_until(lambda: first.ready, "the server answers again")
    engine.load_weights({}, 3)
    assert [server.alive for server in pool.servers] == [True, True] and pool.restarts == 1
    assert "is back at version 3" in capfd.readouterr().err


def test_a_server_whose_starts_fail_is_left_out_with_one_line_naming_why_and_the_run_goes_on(
    launched, monkeypatch, capfd
):
    engine, pool = launched, launched.pool
    first = pool.servers[0]
    failing = [sys.executable, "-c", "import os; print('no memory', flush=True); os.kill(os.getpid(), 9)"]
    monkeypatch.setattr(process_module, "server_command", lambda model_path, host, port, options: failing)
    kill_server(first)
    generate(pool)
    lines: list[str] = []
    wait_until(
        lambda: lines.extend(capfd.readouterr().err.splitlines()) or "left out" in str(lines), "left out"
    )
    starts = [line for line in lines if "starts again" in line]
    assert len(starts) == 2 and "(start 2 of max_restarts=2; the last start failed: " in starts[1]
    (left,) = [line for line in lines if "left out" in line]
    assert (
        f"rollout server {first.url} is left out of the run: 2 starts in a row failed (max_restarts=2; "
        in left
    )
    assert "exited with status 137 (killed by SIGKILL) while starting" in left and "no memory" in left
    assert "fake server" not in left, "the log's lines of the server before (the log is appended to)"
    engine.load_weights({}, 1)
    assert engine.metrics()["rollout/servers_alive"] == 1.0 and not first.ready
    assert generate(pool)["choices"][0]["finish_reason"] == "stop"


def test_closing_the_pool_while_a_server_starts_again_leaves_no_process(launched, monkeypatch):
    pool = launched.pool
    first = pool.servers[0]
    monkeypatch.setenv("FAKE_VLLM_START_S", "3")  # the new start takes 3 s to listen
    kill_server(first)
    generate(pool)
    wait_until(lambda: first.launched.process.poll() is None and _has_server(first), "a start")
    watchdog = psutil.Process(first.launched.process.pid)
    group = [watchdog, *watchdog.children(recursive=True)]
    launched.close()
    for process in group:
        wait_until(lambda process=process: not _running(process), f"{process.pid} ends")
    time.sleep(1.0)  # nothing starts after the close
    assert not first.ready and first.launched.process.pid == watchdog.pid


def _has_server(server: Server) -> bool:
    try:
        server_of(psutil.Process(server.launched.process.pid))
        return True
    except (psutil.Error, ValueError):
        return False


def _running(process: psutil.Process) -> bool:
    try:
        return process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_a_launched_server_lost_after_a_signal_to_the_run_is_not_started_again(launched):
    pool = launched.pool
    run_signal.note()
    kill_server(pool.servers[0])
    generate(pool)
    time.sleep(1.0)  # several restart delays
    assert not pool.servers[0].ready and pool.servers[0].launched.process.poll() is not None


def test_the_last_server_ending_with_the_signal_after_one_was_left_out_says_both(launched):
    """A server left out, then SIGTERM to the run, which ends the other: not "all lost", not "all
    ended with the signal" (the line a new user met after a server was left out)."""
    pool = launched.pool
    pool.healer = None  # the first stays out
    kill_server(pool.servers[0])
    generate(pool)
    run_signal.note()
    kill_server(pool.servers[1])
    with pytest.raises(
        ServersLostError, match=r"^1 of the 2 rollout servers ended with the signal, the others"
    ):
        generate(pool)


def test_a_given_url_that_stops_answering_rejoins_once_it_answers_again_at_the_version(monkeypatch, capfd):
    """A server started by someone else (the stand-in, by hand) is stopped, then started again on its
    port by its owner: it rejoins at the next push, at the run's version."""
    monkeypatch.setattr(healing, "PROBE_EVERY_S", 0.1)
    ports = [free_port(), free_port()]
    started = [subprocess.Popen([sys.executable, str(FAKE), str(port)]) for port in ports]
    urls = [f"http://127.0.0.1:{port}" for port in ports]
    pool = ServerPool([Server(ServerClient(url, 20.0)) for url in urls], max_restarts=1)
    engine = VLLMServerEngine(pool, max_model_len=64)
    try:
        wait_until(lambda: all(server.client.healthy() for server in pool.servers), "the servers start")
        started[0].kill()
        started[0].wait()
        pool.servers[1].outstanding = 1
        generate(pool)
        assert engine.metrics()["rollout/servers_alive"] == 1.0
        time.sleep(0.5)
        assert not pool.servers[0].ready
        started.append(subprocess.Popen([sys.executable, str(FAKE), str(ports[0])]))  # by its owner
        wait_until(lambda: pool.servers[0].ready, "the URL answers again")
        engine.load_weights({}, 5)
        assert engine.metrics() == {"rollout/servers_alive": 2.0, "rollout/server_restarts": 1.0}
        assert pool.servers[0].client.get("/weight_info") == {"weight_version": "5"}
        assert f"rollout server {urls[0]} is back at version 5; 2 of 2 serve" in capfd.readouterr().err
    finally:
        engine.close()
        for process in started:
            process.kill()
            process.wait()


def test_the_ranks_agree_that_a_server_serves_only_once_rank_0_brought_it_back():
    """Two ranks' views of one server: rank 0 loses it, admits it for a push, rejoins it; the MAX of
    the ranks' states tells rank 1 to stop sending to it at once, and to send again only after the rejoin."""
    views = [ServerPool([Server(ServerClient("http://127.0.0.1:9", 1.0))]) for _ in range(2)]
    (rank0,), (rank1,) = (view.servers for view in views)

    def meet() -> list[list[Server]]:
        agreed = [max(ServerPool.state(view.servers[0]) for view in views)]
        return [view.agree(agreed) for view in views]

    assert meet() == [[], []]
    views[0].lose(rank0, RuntimeError("refused"))
    assert meet() == [[], [rank1]]  # rank 1 loses it too (engine.agree_on_servers calls lose)
    views[1].lose(rank1, RuntimeError("rank 0 lost it"))
    rank0.ready = True
    views[0].admit_ready()
    assert rank0.joining and meet() == [[], []] and not rank1.alive  # pushed to, not serving
    views[0].rejoin(1)
    assert meet() == [[], []] and rank1.alive and not rank1.joining and rank1.comebacks == 1
    views[1].lose(rank1, RuntimeError("reset"))  # rank 1 loses the new one: lost for rank 0 too
    assert meet() == [[rank0], []]
    views[0].lose(rank0, RuntimeError("rank 1 lost it"))
    rank0.ready = True
    views[0].rejoin(2)  # nothing joining: nothing rejoins
    views[0].admit_ready()
    views[0].rejoin(2)
    assert meet() == [[], []] and rank1.alive and rank1.comebacks == 2
    views[0].lose(rank0, RuntimeError("killed"))  # lost and admitted again before the ranks meet:
    rank0.ready = True
    views[0].admit_ready()
    assert meet() == [[], [rank1]]  # rank 1 stops sending to it all the same
