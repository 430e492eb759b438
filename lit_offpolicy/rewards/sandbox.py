"""A sandbox for untrusted Python: each run a fresh process, under limits, killed whole at its deadline.

The policy writes the code, so it is treated as hostile. As root (``isolation: "full"``, the default
where the process is root, as CI and containers are) a run:

- runs as a user id of its own (``UID_BASE`` + the scoring process's pid), with no supplementary
  groups: it cannot write the trainer's files, read its ``/proc/<pid>/environ`` or signal it;
- has no network: a new network namespace, whose only interface (loopback) is down;
- writes only to fresh tmpfs mounts on /tmp, /var/tmp and /dev/shm in a new mount namespace (its
  directory is /tmp/run), all gone with the run;
- gets none of the trainer's environment (``PATH``, ``LANG``, ``LC_ALL``, ``HOME``, ``TMPDIR`` only) nor
  its virtual environment's packages: it runs on the base interpreter that the venv links to;
- is limited in CPU seconds, address space, file size, processes (``RLIMIT_NPROC``: its user id
  alone, so a fork bomb stops there), open files, and output (read by the parent up to a cap);
- runs as the init of a PID namespace with its own /proc: the host's processes are out of sight, and
  when it ends, or the process scoring it dies, every process it started ends too;
- is killed at ``timeout_s``; every process of its user id is swept at the end.

What it does not protect against: kernel exploits, CPU and memory time taken from the trainer up to the
limits, and reads of world-readable files (the code can read what any user of the machine can).

Elsewhere (not root) the sandbox refuses to run, with a message; ``isolation: "limits_only"`` runs the
code with the resource limits and the deadline only: same user, network and files as the trainer, its
process group killed at the end (a process that leaves the group survives). Not a security boundary.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from lit_offpolicy.core.checks import check_choice, check_range

LAUNCHER = Path(__file__).with_name("sandbox_launch.py")
UID_BASE = 1_500_000_000
"""Runs as root get the user id ``UID_BASE`` + the scoring process's pid: unused by real accounts,
and distinct for runs that overlap (each scoring process runs one at a time)."""
ISOLATIONS = ("auto", "full", "limits_only")
ENVIRONMENT = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8"}
SETUP_FAILED = 125  # sandbox_launch.SETUP_FAILED
STAGING_PREFIX = "lit-offpolicy-sandbox-"
"""A run's source and input wait in ``<tmp>/lit-offpolicy-sandbox-<pid of the scorer>-XXXX``."""


class SandboxUnavailable(ValueError):
    """The sandbox cannot isolate code here (not root, or the kernel refuses a namespace)."""


@dataclass(frozen=True)
class SandboxLimits:
    """What one run may use."""

    timeout_s: float = 10.0
    """Wall-clock seconds. CPU time too, per process: at ``timeout_s`` (rounded up) the kernel sends
    ``SIGXCPU``, which ends the run as ``timed_out``; one that ignores it is killed a second later."""
    memory_mb: int = 1024
    """Address space of each process (``RLIMIT_AS``)."""
    file_mb: int = 16
    """Largest file it may write (``RLIMIT_FSIZE``), and the size of its tmpfs scratch."""
    processes: int = 32
    """Processes and threads (``RLIMIT_NPROC``; with ``isolation: "full"``, of its own user id)."""
    open_files: int = 64
    """Open file descriptors per process (``RLIMIT_NOFILE``)."""
    output_kb: int = 1024
    """Bytes of stdout and of stderr read (each); more ends the run as ``output_exceeded``."""

    def __post_init__(self) -> None:
        check_range("timeout_s", self.timeout_s, low=0.0, low_inclusive=False)
        for name in ("memory_mb", "file_mb", "processes", "open_files", "output_kb"):
            check_range(name, getattr(self, name), low=1)

    def rlimits(self) -> dict[str, tuple[int, int]]:
        """(soft, hard) per ``resource`` name; all equal but the CPU's (see ``timeout_s``)."""
        cpu_s = max(1, math.ceil(self.timeout_s))
        hard = {
            "RLIMIT_AS": self.memory_mb * 2**20,
            "RLIMIT_FSIZE": self.file_mb * 2**20,
            "RLIMIT_NPROC": self.processes,
            "RLIMIT_NOFILE": self.open_files,
            "RLIMIT_CORE": 0,
        }
        return {"RLIMIT_CPU": (cpu_s, cpu_s + 1)} | {name: (value, value) for name, value in hard.items()}


@dataclass(frozen=True)
class RunResult:
    """How one run ended."""

    returncode: int | None
    """The exit status (negative: the signal that ended it); None where it timed out or said too much."""
    stdout: str
    stderr: str
    timed_out: bool = False
    output_exceeded: bool = False

    @property
    def succeeded(self) -> bool:
        return self.returncode == 0 and not (self.timed_out or self.output_exceeded)


class Sandbox:
    """Runs Python sources, one fresh process each (:meth:`run`), isolated as the module says.

    Args:
        limits: what one run may use.
        isolation: "full" (root only), "limits_only" (anyone; no security boundary), or "auto": "full"
            as root, otherwise a ``SandboxUnavailable`` naming the choices.
    """

    def __init__(self, limits: SandboxLimits | None = None, isolation: str = "auto") -> None:
        self.limits = limits or SandboxLimits()
        self.isolation = check_choice("isolation", isolation, ISOLATIONS)

    def mode(self) -> str:
        """The isolation a run gets here ("full" or "limits_only"); ``SandboxUnavailable`` if none."""
        if self.isolation == "limits_only":
            return "limits_only"
        if os.geteuid() != 0:
            raise SandboxUnavailable(
                f"isolation={self.isolation!r}: running untrusted code in isolation (a user id of its own, "
                f"no network, a private /tmp) needs root, and this process runs as uid {os.geteuid()}. Run "
                "as root (a container), or set isolation: limits_only to run it with resource limits only "
                "(no network isolation; it can read and write what you can)"
            )
        return "full"

    def check(self) -> None:
        """Refuse now, not at the first batch, where runs cannot be isolated: ``mode``, then one run of
        a one-line program (the namespaces, the mounts and the user change happen, or fail, there)."""
        if self.mode() != "full":
            return
        result = self.run("pass")
        if not result.succeeded:
            said = (result.stderr.strip().splitlines() or ["no output"])[-1]
            raise SandboxUnavailable(
                f"the sandbox's test run of `pass` failed (exit status {result.returncode}: {said}); "
                "run with isolation: limits_only"
            )

    def run(self, source: str, stdin: str = "") -> RunResult:
        """Run ``source`` with ``stdin``; how it ended, with its output (each stream at most
        ``limits.output_kb``, decoded as UTF-8 with replacement)."""
        mode = self.mode()
        uid = UID_BASE + os.getpid() if mode == "full" else None
        _remove_stale_staging()
        staging = Path(tempfile.mkdtemp(prefix=f"{STAGING_PREFIX}{os.getpid()}-"))
        try:
            (staging / "program.py").write_text(source)
            (staging / "stdin").write_text(stdin)
            config = {
                "parent": os.getpid(),
                "source": str(staging / "program.py"),
                "directory": str(staging),
                "uid": uid,
                "interpreter": os.path.realpath(sys.executable),  # not a venv's link, maybe under /tmp
                "scratch_bytes": self.limits.file_mb * 2**20,
                "limits": self.limits.rlimits(),
                "env": ENVIRONMENT,
            }
            with (staging / "stdin").open("rb") as stdin_file:
                process = subprocess.Popen(
                    [sys.executable, "-I", "-S", str(LAUNCHER), json.dumps(config)],
                    stdin=stdin_file,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    cwd=staging,
                    env=ENVIRONMENT,
                    start_new_session=True,
                    close_fds=True,
                )
            try:
                return self._collect(process, uid)
            finally:
                _kill_all(process, uid)
        finally:
            shutil.rmtree(staging, ignore_errors=True)

    def _collect(self, process: subprocess.Popen, uid: int | None) -> RunResult:
        """Read stdout and stderr up to the cap until both close and the process ends, or the deadline."""
        deadline = time.monotonic() + self.limits.timeout_s
        cap = self.limits.output_kb * 1024
        output = {process.stdout: bytearray(), process.stderr: bytearray()}
        exceeded = timed_out = False
        with selectors.DefaultSelector() as selector:
            for stream in output:
                selector.register(stream, selectors.EVENT_READ)
            while selector.get_map() and not exceeded:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    timed_out = True
                    break
                for key, _ in selector.select(timeout=remaining):
                    chunk = os.read(key.fd, 65536)
                    if not chunk:
                        selector.unregister(key.fileobj)
                        continue
                    output[key.fileobj] += chunk
                    exceeded = exceeded or len(output[key.fileobj]) > cap
        if not (timed_out or exceeded):
            try:
                process.wait(timeout=max(deadline - time.monotonic(), 0.0))
            except subprocess.TimeoutExpired:  # closed its output, then went on running
                timed_out = True
        timed_out = timed_out or process.returncode == -signal.SIGXCPU  # its CPU time ran out first
        for stream in output:
            stream.close()
        if process.returncode == SETUP_FAILED and uid is not None:
            reason = bytes(output[process.stderr]).decode(errors="replace").strip()
            raise SandboxUnavailable(
                f"the sandbox could not confine a run ({reason}): it needs to create mount and network "
                "namespaces and change user ids (root with CAP_SYS_ADMIN; a container run --privileged); "
                "or set isolation: limits_only to run the code with resource limits only"
            )
        stdout, stderr = (bytes(data[:cap]).decode(errors="replace") for data in output.values())
        returncode = None if (timed_out or exceeded) else process.returncode
        return RunResult(returncode, stdout, stderr, timed_out=timed_out, output_exceeded=exceeded)


def _kill_all(process: subprocess.Popen, uid: int | None) -> None:
    """SIGKILL every process of the run: all of ``uid``'s (a helper that takes that user id and signals
    every process it may, ``kill(-1)``, until none is left), else the process group; then reap."""
    if uid is not None:
        for _ in range(100):
            if not live_processes(lambda found: found == uid):
                break
            subprocess.run(
                [sys.executable, "-I", "-S", "-c", KILL_AS_USER, str(uid)], env=ENVIRONMENT, check=False
            )
    else:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
    process.kill()
    process.wait()


KILL_AS_USER = (
    "import os, signal, sys\nu = int(sys.argv[1])\nos.setgroups([])\nos.setgid(u)\nos.setuid(u)\n"
    "os.kill(-1, signal.SIGKILL)"
)


def _remove_stale_staging() -> None:
    """Remove the staging directories of scoring processes that died mid-run (SIGKILL skips cleanup)."""
    for directory in Path(tempfile.gettempdir()).glob(f"{STAGING_PREFIX}*-*"):
        owner = directory.name[len(STAGING_PREFIX) :].split("-", 1)[0]
        if owner.isdigit() and not Path("/proc", owner).exists():
            shutil.rmtree(directory, ignore_errors=True)


def live_processes(uid_matches: Callable[[int], bool]) -> list[int]:
    """The live pids whose real user id ``uid_matches`` (/proc/PID/status; the directory's owner can
    read root for a process that changed its credentials); zombies, already dead, are left out."""
    found = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            status = Path(entry.path, "status").read_text()
        except OSError:  # it ended while we looked
            continue
        fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
        real = fields.get("Uid", "").split()[:1]
        if real and uid_matches(int(real[0])) and not fields.get("State", "").strip().startswith("Z"):
            found.append(int(entry.name))
    return found
