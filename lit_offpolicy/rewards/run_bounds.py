"""One memory bound and one process bound for a whole sandbox run: all its processes together.

Where this process may create cgroups (root, and a cgroup v2 whose ``memory`` and ``pids`` controllers
reach the children of this process's cgroup or of its parent, or cgroup v1's ``memory`` and ``pids``
hierarchies), each run gets a cgroup of its own there: ``memory.max`` (v1: ``memory.limit_in_bytes``)
and ``pids.max``, kept by the kernel (a fork past the bound fails; memory past it is reclaimed or
OOM-killed inside the run only). When the kernel's OOM killer fires in a run, the whole run is killed
(v2: ``memory.oom.group``; v1: the next poll sees ``oom_kill`` and kills the rest).

Elsewhere a watchdog polls the run's process tree every ``WATCHDOG_PERIOD_S`` and kills the whole run
when the resident memory of its processes, summed, passes the bound (shared pages count once per
process, so it errs on the side of killing). It can be overshot by what the run allocates between two
polls (docs/rewards.md gives the figure); processes are bounded by ``RLIMIT_NPROC`` of the run's own
user id (the sandbox sets it).
"""

from __future__ import annotations

import contextlib
import itertools
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path

RUN_PREFIX = "lit-offpolicy-run-"
_RUN_NUMBERS = itertools.count()
"""Numbers a process's runs across all its cgroup bounds (a reward keeps one sandbox per test count)."""
WATCHDOG_PERIOD_S = 0.05
PAGE_BYTES = os.sysconf("SC_PAGE_SIZE")


@dataclass(frozen=True)
class Bounds:
    memory_bytes: int
    processes: int


class Watchdog:
    """Sums the resident memory of the process tree under the run's first process; kills it at the bound."""

    period_s = WATCHDOG_PERIOD_S

    def __init__(self, bounds: Bounds) -> None:
        self.bounds = bounds

    def describe(self) -> str:
        return (
            f"a watchdog (no cgroup could be created here): the run's resident memory summed every "
            f"{WATCHDOG_PERIOD_S * 1000:.0f} ms, the run killed past {self.bounds.memory_bytes >> 20} MB; "
            f"processes: {self.bounds.processes} (RLIMIT_NPROC of the run's user id)"
        )

    def start(self) -> None:
        """Nothing to set up."""

    def enter(self) -> None:
        """Nothing to join (the run's processes are found by their parents)."""

    def exceeded(self, root: int) -> bool:
        return sum(rss for _, rss in _tree(root)) > self.bounds.memory_bytes

    def kill(self, root: int) -> None:
        for pid, _ in _tree(root):
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)

    def close(self) -> None:
        """Nothing to remove."""


class Cgroup:
    """One cgroup per run, in each hierarchy that holds ``memory`` or ``pids`` (one for v2, two for v1)."""

    period_s = WATCHDOG_PERIOD_S

    def __init__(self, bounds: Bounds, version: int, parents: list[Path]) -> None:
        self.bounds, self.version, self.parents = bounds, version, parents
        self.directories: list[Path] = []
        self._lingering: list[Path] = []  # earlier runs' cgroups whose processes were still dying

    def describe(self) -> str:
        return (
            f"a cgroup v{self.version} per run under {self.parents[0]}: memory "
            f"{self.bounds.memory_bytes >> 20} MB and {self.bounds.processes} processes, for all of a "
            "run's processes together"
        )

    def start(self) -> None:
        """A fresh cgroup with the bounds, named by this process and a count of its runs (an earlier
        run's, whose processes are still dying under load, is removed later; it never blocks this one)."""
        self.close()
        _kill(_pids(self._lingering))
        self._lingering = [directory for directory in self._lingering if not _removed(directory)]
        name = f"{RUN_PREFIX}{os.getpid()}-{next(_RUN_NUMBERS)}"
        self.directories = [parent / name for parent in self.parents]
        for directory in self.directories:
            directory.mkdir()
        memory, pids = str(self.bounds.memory_bytes), str(self.bounds.processes)
        if self.version == 2:
            settings = {
                "memory.max": memory,
                "memory.swap.max": "0",
                "memory.oom.group": "1",
                "pids.max": pids,
            }
        else:
            settings = {
                "memory.limit_in_bytes": memory,
                "memory.memsw.limit_in_bytes": memory,
                "pids.max": pids,
            }
        for name, value in settings.items():
            for directory in self.directories:
                if (directory / name).exists():
                    (directory / name).write_text(value)

    def enter(self) -> None:
        """Move the calling process into the run's cgroup (in the child, before it becomes bubblewrap)."""
        for directory in self.directories:
            (directory / "cgroup.procs").write_text(str(os.getpid()))

    def exceeded(self, root: int) -> bool:
        """The kernel's OOM killer fired in the run (its bound is the kernel's to keep)."""
        name = "memory.events" if self.version == 2 else "memory.oom_control"
        for directory in self.directories:
            with contextlib.suppress(OSError):
                fields = dict(line.split() for line in (directory / name).read_text().splitlines())
                if int(fields.get("oom_kill", 0)) > 0:
                    return True
        return False

    def kill(self, root: int) -> None:
        _kill(self.pids())

    def pids(self) -> list[int]:
        return _pids(self.directories)

    def close(self) -> None:
        """Kill what is left and remove the cgroup (a cgroup with processes cannot be removed: one whose
        processes are still dying after 10 s is left to the next ``start``)."""
        for directory in self.directories:
            deadline = time.monotonic() + 10.0
            while directory.exists() and not _removed(directory):
                self.kill(0)
                if time.monotonic() > deadline:
                    self._lingering.append(directory)
                    break
                time.sleep(0.005)
        self.directories = []


def run_bounds(memory_bytes: int, processes: int) -> Cgroup | Watchdog:
    """A cgroup per run where one can be created here (v2 first), else the watchdog."""
    bounds = Bounds(memory_bytes, processes)
    for version, parents in ((2, _v2_parents()), (1, _v1_parents())):
        if not parents:
            continue
        _remove_stale(parents)
        candidate = Cgroup(bounds, version, parents)
        try:
            candidate.start()
            candidate.close()
        except OSError:
            continue
        return candidate
    return Watchdog(bounds)


def _pids(directories: list[Path]) -> list[int]:
    found: set[int] = set()
    for directory in directories:
        with contextlib.suppress(OSError):
            found.update(int(pid) for pid in (directory / "cgroup.procs").read_text().split())
    return sorted(found)


def _kill(pids: list[int]) -> None:
    for pid in pids:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)


def _removed(directory: Path) -> bool:
    try:
        directory.rmdir()
    except FileNotFoundError:
        return True
    except OSError:  # processes left in it
        return False
    return True


def _remove_stale(parents: list[Path]) -> None:
    """Kill what is left in the run cgroups of scoring processes that died, and remove them: SIGKILL
    skips ``close``, and a run's bubblewrap was seen to outlive its scorer once (a reward worker killed
    as the trainer ended on a second Ctrl-C: its pid-1 process left waiting, ignoring SIGTERM)."""
    for parent in parents:
        for directory in parent.glob(f"{RUN_PREFIX}*"):
            owner = directory.name[len(RUN_PREFIX) :].split("-")[0]
            if not owner.isdigit() or Path("/proc", owner).exists():
                continue
            deadline = time.monotonic() + 2.0
            while not _removed(directory) and time.monotonic() < deadline:
                _kill(_pids([directory]))
                time.sleep(0.01)


def _v2_parents() -> list[Path]:
    """This process's cgroup v2 directory, else its parent (a cgroup with processes cannot enable
    controllers for children, so a delegated one holds this process in a leaf), where the children
    have ``memory`` and ``pids``: enabled by whoever set it up, not by this process."""
    mounts = _cgroup_mounts()
    own = _own_cgroups()
    if "cgroup2" not in mounts or "" not in own:
        return []
    directory = _join(*mounts["cgroup2"], own[""])
    for candidate in (directory, directory.parent):
        try:
            if {"memory", "pids"} <= set((candidate / "cgroup.subtree_control").read_text().split()):
                return [candidate]
        except OSError:
            continue
    return []


def _v1_parents() -> list[Path]:
    """This process's cgroup v1 directories in the ``memory`` and the ``pids`` hierarchies."""
    mounts = _cgroup_mounts()
    own = _own_cgroups()
    if not {"memory", "pids"} <= mounts.keys() or not {"memory", "pids"} <= own.keys():
        return []
    return [_join(*mounts[name], own[name]) for name in ("memory", "pids")]


def _cgroup_mounts() -> dict[str, tuple[str, str]]:
    """(mount point, root in the hierarchy) per v1 controller, and "cgroup2" for v2 (/proc/self/mountinfo)."""
    found: dict[str, tuple[str, str]] = {}
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        fields = line.split()
        tail = fields[fields.index("-") + 1 :]
        kind, options = tail[0], tail[2].split(",")
        if kind == "cgroup2":
            found.setdefault("cgroup2", (fields[4], fields[3]))
        elif kind == "cgroup":
            for name in ("memory", "pids"):
                if name in options:
                    found.setdefault(name, (fields[4], fields[3]))
    return found


def _own_cgroups() -> dict[str, str]:
    """This process's cgroup path per v1 controller, and "" for v2 (/proc/self/cgroup)."""
    found: dict[str, str] = {}
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        for name in controllers.split(",") if controllers else [""]:
            found[name] = path
    return found


def _join(mount_point: str, mount_root: str, path: str) -> Path:
    """The directory of cgroup ``path`` under a mount of the hierarchy's ``mount_root``."""
    relative = os.path.relpath(path, mount_root)
    return Path(mount_point) if relative == "." else Path(mount_point, relative)


def _tree(root: int) -> list[tuple[int, int]]:
    """(pid, resident bytes) of ``root`` and its descendants (/proc/PID/stat: parent, RSS pages)."""
    parents: dict[int, int] = {}
    resident: dict[int, int] = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat", "rb") as file:
                stat = file.read()
        except OSError:  # it ended while we looked
            continue
        fields = stat[stat.rindex(b")") + 2 :].split()  # after "pid (comm) "
        parents[int(entry.name)] = int(fields[1])
        resident[int(entry.name)] = int(fields[21]) * PAGE_BYTES
    members = {root} if root in parents else set()
    grew = True
    while grew:
        added = {pid for pid, parent in parents.items() if parent in members} - members
        members |= added
        grew = bool(added)
    return [(pid, resident[pid]) for pid in members]
