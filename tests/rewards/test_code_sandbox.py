"""``CodeExecutionReward`` and its sandbox: hand-scored layouts, then the adversarial set.

Every attack is real code run by the real sandbox, scored in a reward worker process as in training
(``IsolatedReward``): each ends within its limit, scores 0 (the attack's own test passes only if the
attack worked), and the trainer's files, environment, processes and network stay untouched. The full
sandbox needs root (CI runs as root); elsewhere these tests skip and the reward refuses to start.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from lit_offpolicy.rewards import (
    CodeExecutionReward,
    IsolatedReward,
    RewardInputs,
    Sandbox,
    SandboxLimits,
    SandboxUnavailable,
    WeightedRewards,
)
from lit_offpolicy.rewards.code import code_tests, extract_code
from lit_offpolicy.rewards.run_bounds import RUN_PREFIX, Bounds, Cgroup, Watchdog, run_bounds
from lit_offpolicy.rewards.sandbox import UID_BASE, live_processes

TIMEOUT_S = 2.0
SLACK_S = 5.0  # start-up of two interpreters, the kill and the reaping, on a slow, busy machine
root_only = pytest.mark.skipif(os.geteuid() != 0, reason="the full sandbox needs root (CI runs as root)")
processes = pytest.mark.slow  # processes and limits, not floats: test-numerics leaves them out


def fenced(code: str) -> str:
    return f"Here is my solution:\n```python\n{code}\n```\nDone."


def inputs(completions: list[str], **columns: list) -> RewardInputs:
    """One problem per completion, with its data row's ``columns`` (as the data module gives them)."""
    problems = [
        {"prompt": "p", "answer": "", "columns": {name: values[i] for name, values in columns.items()}}
        for i in range(len(completions))
    ]
    return RewardInputs.of(problems, completions, [[0]] * len(completions))


# ------------------------------------------------------------------ layouts, scored by hand


def test_code_is_the_last_python_block():
    text = "```bash\nls\n```\n```python\nx = 1\n```\n```\ny = 2\n```"
    assert extract_code(text) == "y = 2\n"
    assert extract_code("```py\nz = 3\n```") == "z = 3\n" and extract_code("no code") is None


def test_each_dataset_layout_becomes_its_tests():
    io = {"inputs": ["1 2\n"], "outputs": ["3\n"]}
    (stdin_test,) = code_tests("c", {"input_output": json.dumps(io)})
    assert (stdin_test.program, stdin_test.stdin, stdin_test.expected_stdout) == ("c", "1 2\n", "3\n")
    call = code_tests("c", {"input_output": {"fn_name": "f", "inputs": [[1, 2]], "outputs": [[3]]}})[0]
    assert call.call and call.stdin == "[1, 2]" and call.passed("3\n") and call.passed("[3]\n")
    assert call.expected_value == [3] and not call.passed("4\n")
    open_r1 = {"test_cases": [{"input": "5", "output": "25", "type": "stdin_stdout"}]}
    assert code_tests("c", {"verification_info": json.dumps(open_r1)})[0].expected_stdout == "25"
    mbpp = code_tests(
        "c", {"test_list": ["assert f(1) == 2", "assert f(2) == 3"], "test_setup_code": "import math"}
    )
    assert [t.program for t in mbpp] == [
        "c\n\nimport math\nassert f(1) == 2\n",
        "c\n\nimport math\nassert f(2) == 3\n",
    ]
    (humaneval,) = code_tests(
        "c", {"test": "def check(candidate):\n    assert candidate(1) == 2\n", "entry_point": "f"}
    )
    assert humaneval.program.endswith("\ncheck(f)\n")
    assert code_tests("c", {"answer": "4"}) is None
    assert stdin_test.passed("3   \n\n") and not stdin_test.passed("3 4\n")  # trailing space and lines


@processes
@root_only
def test_scores_are_the_fraction_of_tests_passed():
    """Hand-scored: 2 of 2, 1 of 2, no code (0, malformed), no tests (None), stdin 2 of 2, call 1 of 2."""
    reward = CodeExecutionReward(timeout_s=TIMEOUT_S)
    add = fenced("def add(a, b):\n    return a + b")
    half = fenced("def add(a, b):\n    return a + b if a else 0")
    reads = fenced("a, b = map(int, input().split())\nprint(a + b)")
    asserts = ["assert add(1, 2) == 3", "assert add(0, 5) == 5"]
    stdin_io = json.dumps({"inputs": ["1 2\n", "3 4\n"], "outputs": ["3\n", "7"]})
    call_io = json.dumps({"fn_name": "add", "inputs": [[1, 2], [2, 2]], "outputs": [[3], 5]})
    out = reward(
        [add, half, "I cannot", add, reads, add],
        test_list=[asserts, asserts, asserts, None, None, None],
        input_output=[None, None, None, None, stdin_io, call_io],
    )
    assert out.scores == [1.0, 0.5, 0.0, None, 1.0, 0.5] and out.num_malformed == 1


def test_without_root_the_sandbox_refuses_unless_told_limits_only(monkeypatch):
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    with pytest.raises(
        SandboxUnavailable, match=r"needs root, and this process runs as uid 1000.*limits_only"
    ):
        CodeExecutionReward()
    assert Sandbox(isolation="limits_only").mode() == "limits_only"
    with pytest.raises(ValueError, match="isolation='none' is not supported; allowed values: 'auto', 'full'"):
        Sandbox(isolation="none")
    with pytest.raises(ValueError, match="timeout_s=0"):
        SandboxLimits(timeout_s=0)


@processes
def test_limits_only_runs_code_as_this_user_with_the_limits():
    sandbox = Sandbox(SandboxLimits(timeout_s=TIMEOUT_S), isolation="limits_only")
    result = sandbox.run("import os\nprint(input(), os.getuid())", "hi\n")
    assert result.succeeded and result.stdout == f"hi {os.getuid()}\n"
    started = time.monotonic()
    assert sandbox.run("while True: pass").timed_out
    assert time.monotonic() - started < TIMEOUT_S + SLACK_S


def test_the_cpu_limit_is_soft_at_the_timeout_and_hard_a_second_later():
    assert SandboxLimits(timeout_s=2.5).rlimits()["RLIMIT_CPU"] == (3, 4)
    assert SandboxLimits(timeout_s=0.1).rlimits()["RLIMIT_CPU"] == (1, 2)


@processes
def test_a_run_ended_by_its_cpu_limit_counts_as_timed_out():
    """The kernel's SIGXCPU (here sent by the program itself, so the test does not race the wall-clock
    deadline) ends the run as timed out, as the deadline would have."""
    sandbox = Sandbox(SandboxLimits(timeout_s=TIMEOUT_S), isolation="limits_only")
    result = sandbox.run("import os, signal\nos.kill(os.getpid(), signal.SIGXCPU)")
    assert result.timed_out and result.returncode is None and not result.succeeded


# ------------------------------------------------------------------ the adversarial set


@pytest.fixture
def scored_in_a_worker():
    """Score one completion with the given ``test_list`` in a reward worker process, as training does:
    (score, seconds, the worker's restarts)."""
    reward = IsolatedReward(
        WeightedRewards({"code": CodeExecutionReward(timeout_s=TIMEOUT_S)}), timeout=120.0
    )

    def score(code: str, test_list: list[str]) -> tuple[float, float, int]:
        started = time.monotonic()
        out = reward(inputs([fenced(code)], test_list=[test_list]))
        assert out.by_function["code"] != [None], "the row's tests did not reach the reward"
        return out.scores[0], time.monotonic() - started, out.worker_restarts

    yield score
    reward.close()


def _no_process_left() -> None:
    """No process runs under the sandbox user id of a scorer of this test (each run's id is UID_BASE +
    its scoring pid; other processes' runs on the same machine are not this test's)."""
    left = _sandbox_processes()
    assert not left, f"sandbox processes left: {left}"


ATTACKS = {
    "an infinite loop": ("while True:\n    pass", ["assert True"]),
    "a fork bomb": (
        "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass",
        ["assert True"],
    ),
    "a memory bomb": ("blocks = []\nwhile True:\n    blocks.append(bytearray(2**26))", ["assert True"]),
    "a gigabyte of output": (
        "import sys\nfor _ in range(2**14):\n    sys.stdout.write('x' * 2**16)",
        ["assert True"],
    ),
    "signal games (SIGXCPU, SIGALRM, SIGTERM ignored; alarm re-armed)": (
        "import signal\nfor s in (signal.SIGXCPU, signal.SIGALRM, signal.SIGTERM, signal.SIGINT):\n"
        "    signal.signal(s, signal.SIG_IGN)\nsignal.alarm(1)\nwhile True:\n    signal.alarm(1)",
        ["assert True"],
    ),
    "stdout closed early, then a hang": (
        "import os, time\nos.close(1)\nos.close(2)\ntime.sleep(3600)",
        ["assert True"],
    ),
    "a child that leaves the session and lives on": (
        "import os, time\nif os.fork() == 0:\n    os.setsid()\n    time.sleep(3600)",
        ["assert False"],
    ),
}


@processes
@root_only
@pytest.mark.parametrize("attack", list(ATTACKS))
def test_an_attack_ends_within_its_limit_with_score_0(attack, scored_in_a_worker):
    code, tests = ATTACKS[attack]
    score, seconds, restarts = scored_in_a_worker(code, tests)
    assert score == 0.0 and restarts == 0
    assert seconds < TIMEOUT_S + SLACK_S, f"{attack}: {seconds:.1f} s"
    _no_process_left()


@processes
@root_only
def test_code_cannot_touch_the_trainer_s_files_or_leave_its_directory(tmp_path, scored_in_a_worker):
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(b"weights")
    escape, var_escape = (Path(d) / f"lit-offpolicy-escape-{os.getpid()}" for d in ("/tmp", "/var/tmp"))
    mine = [str(weights), str(tmp_path / "new"), "/etc/x"]
    code = f"""
import os
written = []
for path in {[*mine, str(escape), str(var_escape)]!r}:
    try:
        open(path, "a").write("x")
        written.append(path)
    except OSError:
        pass
try:
    os.remove({str(weights)!r})
    written.append("removed")
except OSError:
    pass
assert set(written) & {{*{mine!r}, "removed"}}
"""
    score, _, restarts = scored_in_a_worker(code, ["assert True"])
    assert score == 0.0 and restarts == 0
    assert weights.read_bytes() == b"weights" and sorted(p.name for p in tmp_path.iterdir()) == [
        "model.safetensors"
    ]
    assert not escape.exists() and not var_escape.exists()  # its /tmp and /var/tmp were its own, and are gone


@processes
@root_only
def test_a_virtual_environment_under_tmp_runs_code_on_its_base_interpreter(tmp_path, monkeypatch):
    """A venv's ``bin/python`` under /tmp (a link to the base interpreter) is hidden by the run's own
    /tmp: the program runs on the interpreter the link resolves to."""
    venv_python = tmp_path / "venv" / "bin" / "python"
    venv_python.parent.mkdir(parents=True)
    venv_python.symlink_to(os.path.realpath(sys.executable))
    monkeypatch.setattr(sys, "executable", str(venv_python))
    result = Sandbox(SandboxLimits(timeout_s=TIMEOUT_S)).run("import sys\nprint(sys.executable)")
    assert result.succeeded, result.stderr
    assert result.stdout == f"{os.path.realpath(sys.executable)}\n"


@processes
@root_only
def test_code_cannot_read_the_trainer_s_environment(monkeypatch, scored_in_a_worker):
    """A secret in the trainer's environment: in ``os.environ`` of the scoring process, and in the
    exec-time environment (``/proc/PID/environ``) of a process of the trainer's user."""
    secret = f"secret-{os.getpid()}-{time.monotonic_ns()}"
    monkeypatch.setenv("LIT_OFFPOLICY_TEST_SECRET", secret)
    trainer_like = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(120)"], env=dict(os.environ)
    )
    try:
        code = f"""
import os
found = " ".join(os.environ.values())
for pid in (os.getppid(), {trainer_like.pid}, 1):
    try:
        found += open(f"/proc/{{pid}}/environ", "rb").read().decode(errors="replace")
    except OSError:
        pass
assert {secret!r} in found
"""
        score, _, restarts = scored_in_a_worker(code, ["assert True"])
        assert score == 0.0 and restarts == 0
        leak = Sandbox(SandboxLimits(timeout_s=TIMEOUT_S)).run(code.replace("assert", "print(found) #"))
        assert leak.succeeded and secret not in leak.stdout
    finally:
        trainer_like.kill()
        trainer_like.wait()


@processes
@root_only
def test_code_cannot_reach_a_listener_on_the_loopback(scored_in_a_worker):
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(TIMEOUT_S + SLACK_S)
    port = listener.getsockname()[1]
    accepted = []
    thread = threading.Thread(target=lambda: accepted.append(_accept(listener)), daemon=True)
    thread.start()
    code = f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=1).sendall(b'leak')"
    score, _, restarts = scored_in_a_worker(code, ["assert True"])
    thread.join()
    listener.close()
    assert score == 0.0 and restarts == 0 and accepted == [None]


def _accept(listener: socket.socket) -> bytes | None:
    try:
        connection, _ = listener.accept()
    except TimeoutError:
        return None
    with connection:
        return connection.recv(16)


@processes
@root_only
def test_code_cannot_signal_the_trainer_or_its_worker(scored_in_a_worker):
    """SIGKILL to its parent (the reward worker), to the trainer, to a process of the trainer's user,
    to pid 1 and to every process it may (-1). Only its own PID namespace is in reach: the worker is not
    restarted, the victim and the trainer live. The run's own harness is in reach (the same user id):
    killed, it fails the sample's tests, so the program gains nothing (score 0)."""
    victim = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    code = f"""
import os, signal
for pid in (os.getppid(), {os.getpid()}, {victim.pid}, 1, -1):
    try:
        os.kill(pid, signal.SIGKILL)
    except OSError:
        pass
"""
    try:
        score, _, restarts = scored_in_a_worker(code, ["assert True"])
        assert score == 0.0 and restarts == 0
        assert victim.poll() is None, "the victim process was killed"
    finally:
        victim.kill()
        victim.wait()
    _no_process_left()


@processes
@root_only
def test_a_process_left_in_a_dead_scorer_s_run_cgroup_is_killed_at_the_next_start():
    """A run's process that outlived its scorer (a bubblewrap seen once after a second Ctrl-C, ignoring
    SIGTERM) is killed, and its cgroup removed, when a sandbox next chooses its bounds."""
    bounds = run_bounds(256 * 2**20, 8)
    if not isinstance(bounds, Cgroup):
        pytest.skip("no cgroup can be made here: the watchdog is in force")
    dead = subprocess.Popen(["true"])
    dead.wait()
    stale = [parent / f"{RUN_PREFIX}{dead.pid}-0" for parent in bounds.parents]
    stray = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)",
        ]
    )
    try:
        for directory in stale:
            directory.mkdir()
            (directory / "cgroup.procs").write_text(str(stray.pid))
        run_bounds(256 * 2**20, 8)
        assert stray.wait(timeout=10) == -signal.SIGKILL
        assert not any(directory.exists() for directory in stale)
    finally:
        stray.kill()
        for directory in stale:
            with contextlib.suppress(OSError):
                directory.rmdir()


RUN_A_SLEEPER = (
    "from lit_offpolicy.rewards import Sandbox, SandboxLimits\n"
    "Sandbox(SandboxLimits(timeout_s=600)).run('import os, time\\nos.fork()\\ntime.sleep(3600)')\n"
)


def _sandbox_processes(scorer: int | None = None) -> list[int]:
    """Live processes of the runs of ``scorer``, else of this process and its descendants."""
    scorers = {scorer} if scorer else {os.getpid(), *_descendants(os.getpid())}
    return live_processes(lambda uid: uid - UID_BASE in scorers)


def _descendants(pid: int) -> set[int]:
    parents = {}
    for entry in Path("/proc").iterdir():
        try:
            parents[int(entry.name)] = int(Path(entry, "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (ValueError, OSError):
            continue
    found, grew = set(), {pid}
    while grew:
        grew = {child for child, parent in parents.items() if parent in grew} - found
        found |= grew
    return found


@processes
@root_only
def test_a_run_dies_with_the_process_that_scores_it():
    """SIGKILL to the scoring process (a reward worker killed by the kernel) while its run and the
    run's child sleep: bubblewrap dies with its parent, the sandbox's init with bubblewrap, and every
    process of its PID namespace with the init. Nothing is left, though nobody ended the run; the next
    run of a scorer with the same pid would start in a fresh cgroup."""
    scorer = subprocess.Popen([sys.executable, "-c", RUN_A_SLEEPER])
    try:
        deadline = time.monotonic() + 60
        while len(_sandbox_processes(scorer.pid)) < 2:
            assert scorer.poll() is None and time.monotonic() < deadline, "the run did not start"
            time.sleep(0.05)
    finally:
        scorer.kill()
        scorer.wait()
    deadline = time.monotonic() + SLACK_S
    while _sandbox_processes(scorer.pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _sandbox_processes(scorer.pid) == []


# ------------------------------------------------------------------ what outlives a run, and per-run bounds

SHARED_PLACES = ("/run/lock", "/var/lock", "/dev/shm", "/var/tmp", "/tmp")


@processes
@root_only
def test_no_file_a_run_leaves_outside_its_directory_reaches_the_next_run(scored_in_a_worker):
    """Each run checks for markers in the shared writable places a host has (/run/lock, also
    /var/lock; /dev/shm, /var/tmp, /tmp), then leaves its own there. Its test passes only if the
    earlier run's marker was still there; none of them is on the host after."""
    marker = f"lit-offpolicy-left-{os.getpid()}-{time.monotonic_ns()}"
    code = f"""
import os
places = {SHARED_PLACES!r}
found = [p for p in places if os.path.exists(os.path.join(p, {marker!r}))]
for place in places:
    try:
        open(os.path.join(place, {marker!r}), "w").write("x")
    except OSError:
        pass
"""
    try:
        score, _, restarts = scored_in_a_worker(code, ["assert found", "assert found"])
        assert score == 0.0 and restarts == 0
        assert [p for p in SHARED_PLACES if Path(p, marker).exists()] == []
    finally:
        for place in SHARED_PLACES:
            Path(place, marker).unlink(missing_ok=True)


@processes
@root_only
def test_code_cannot_reach_a_unix_socket_on_the_host_s_filesystem(scored_in_a_worker):
    """A listener on a UNIX socket with a path (mode 0777, outside /tmp: in /run, else /var/tmp) that
    anyone may connect to: the network namespace does not cover it, the run's own root does."""
    place = Path("/run") if Path("/run").is_dir() else Path("/var/tmp")
    path = place / f"lit-offpolicy-listener-{os.getpid()}.sock"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(path))
    path.chmod(0o777)
    listener.listen()  # a connection waits in the backlog: accepted after the run, without waiting
    listener.setblocking(False)
    code = f"import socket\ns = socket.socket(socket.AF_UNIX)\ns.connect({str(path)!r})\ns.sendall(b'leak')"
    try:
        score, _, restarts = scored_in_a_worker(code, ["assert True"])
        assert score == 0.0 and restarts == 0
        with pytest.raises(BlockingIOError):
            listener.accept()
    finally:
        listener.close()
        path.unlink(missing_ok=True)


@processes
@root_only
def test_code_cannot_read_world_readable_files_of_the_host(scored_in_a_worker):
    """A secret in a world-readable file (mode 0644) in the repository (the trainer's directory), /etc,
    /var/tmp, /home and /root: none of them is in the run's root."""
    secret = f"secret-{os.getpid()}-{time.monotonic_ns()}"
    places = [Path(__file__).resolve().parents[2], Path("/etc"), Path("/var/tmp")]
    places += [Path(p) for p in ("/home", "/root") if Path(p).is_dir()]
    files = [place / f".lit-offpolicy-secret-{os.getpid()}" for place in places]
    for file in files:
        file.write_text(secret)
        file.chmod(0o644)
    code = f"""
found = ""
for path in {[str(f) for f in files]!r}:
    try:
        found += open(path).read()
    except OSError:
        pass
assert {secret!r} in found
"""
    try:
        score, _, restarts = scored_in_a_worker(code, ["assert True"])
        assert score == 0.0 and restarts == 0
    finally:
        for file in files:
            file.unlink(missing_ok=True)


MEMORY_FORK = """
import os, time
read, write = os.pipe()
for _ in range({children}):
    if os.fork() == 0:
        held = bytearray(b"x") * ({megabytes} * 2**20)  # written, so resident
        os.write(write, b"1")
        time.sleep(60)
os.close(write)
up = 0
while up < {children}:
    up += len(os.read(read, 1))
"""


@processes
@root_only
def test_a_memory_fork_is_killed_at_the_run_s_bound():
    """4 children, each holding 900 MB, under memory_mb 1024 (the default): each fits the address-space
    limit of one process, together they pass the run's bound. Its test passes only if all 4 held their
    memory at once (a per-process bound lets them: ~12 s here, hence the long deadline); the run is
    killed within seconds, and the scoring worker lives on."""
    reward = IsolatedReward(WeightedRewards({"code": CodeExecutionReward(timeout_s=60.0)}), timeout=120.0)
    try:
        started = time.monotonic()
        out = reward(
            inputs([fenced(MEMORY_FORK.format(children=4, megabytes=900))], test_list=[["assert True"]])
        )
        assert out.scores == [0.0] and out.worker_restarts == 0
        assert time.monotonic() - started < 20.0
    finally:
        reward.close()
    _no_process_left()


@processes
@root_only
def test_the_watchdog_kills_a_memory_fork_at_the_run_s_bound():
    """The same attack where no cgroup can be made (the watchdog in force; smaller, to keep it fast):
    4 children x 200 MB under a 256 MB bound; the run is killed, not its scorer."""
    sandbox = Sandbox(SandboxLimits(timeout_s=TIMEOUT_S + SLACK_S, memory_mb=256))
    sandbox._bounds = Watchdog(Bounds(256 * 2**20, sandbox.limits.processes))
    started = time.monotonic()
    result = sandbox.run(MEMORY_FORK.format(children=4, megabytes=200))
    assert not result.succeeded and not result.timed_out, result
    assert time.monotonic() - started < TIMEOUT_S
    assert _sandbox_processes() == []


@processes
@root_only
def test_a_pids_fork_stops_at_the_run_s_process_bound(scored_in_a_worker):
    """40 sleeping children at once, past ``processes`` (32, bubblewrap's two included): forks fail at
    the bound; its test passes only if all 40 were started. 40 short-lived children one after another
    (a test harness's pattern) are within the bound."""
    at_once = "import os, time\nfor _ in range(40):\n    if os.fork() == 0:\n        time.sleep(60)\n"
    score, _, restarts = scored_in_a_worker(at_once, ["assert True"])
    assert score == 0.0 and restarts == 0
    _no_process_left()
    in_turn = "import os\nfor _ in range(40):\n    pid = os.fork()\n    if pid == 0:\n        os._exit(0)\n"
    in_turn += "    os.waitpid(pid, 0)\n"
    score, _, restarts = scored_in_a_worker(in_turn, ["assert True"])
    assert score == 1.0 and restarts == 0
