"""A throwaway SLURM cluster on this machine, for tests: its own MUNGE daemon and key, one slurmctld
and three slurmd (nodes ``node1`` to ``node3``, each given this machine's CPUs), everything under one
directory and listening on 127.0.0.1 only.

Debian's ``slurm-wlm`` (22.05) is built with ``--enable-multiple-slurmd``, so several slurmd can
run on one host, each with its own node name (``slurmd -N``) and port. Every daemon runs in the
foreground as a child of the test process; :meth:`LocalSlurm.stop` cancels the jobs, stops the
daemons and kills whatever still carries the cluster's marker in its environment (job steps,
``slurmstepd``), then removes the directory. Where the test process ends without ``stop()`` (Ctrl-C
ends pytest-xdist's workers; a SIGKILL), the cluster's reaper does the killing (``slurm_reaper.py``).
Standard library only: a test's own process can start a cluster in a second.
"""

from __future__ import annotations

import os
import random
import re
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

from helpers import slurm_reaper
from helpers.slurm_reaper import MARKER

NODES = ("node1", "node2", "node3")
DAEMONS = ("munged", "slurmctld", "slurmd", "sbatch", "scontrol", "scancel", "squeue")
# scontrol's view of a job that ended, as far as these tests care
ENDED = {"COMPLETED", "CANCELLED", "FAILED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE"}
# set by the rendezvous of earlier in-process runs; a job must derive its own from SLURM
TORCH_DISTRIBUTED = {"MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK", "NODE_RANK"}
TORCH_DISTRIBUTED |= {"LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE"}


def missing_commands() -> list[str]:
    return [name for name in DAEMONS if shutil.which(name) is None]


def free_port() -> int:
    """A TCP port nothing listens on now on 127.0.0.1 (as the servers' own, which a test's process
    would pay 6 CPU s of imports for: lit_offpolicy.rollout.server.process.free_port)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def port_is_free(port: int) -> bool:
    with socket.socket() as probe:
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def first_job_id() -> int:
    """A first job id whose Lightning port (15000 + the id's last 4 digits) and the next few are free,
    so that clusters of tests run side by side do not hand their jobs the same port."""
    while True:
        job_id = random.randrange(1000, 9000)
        if all(port_is_free(15000 + job_id + k) for k in range(8)):
            return job_id


class LocalSlurm:
    """``start()`` it, submit with ``sbatch(...)``, read jobs with ``job(...)``; ``stop()`` always."""

    def __init__(self, root: Path, environment: dict[str, str]) -> None:
        """``environment``: the base of the daemons' and jobs' environments (sbatch passes its own on)."""
        self.root = root
        self.environment = {
            k: v for k, v in environment.items() if not k.startswith("SLURM_") and k not in TORCH_DISTRIBUTED
        }
        self.conf = root / "slurm.conf"
        self.jobcomp = root / "jobcomp.txt"
        self.daemons: dict[str, subprocess.Popen] = {}
        self.reaper: subprocess.Popen | None = None
        self.hostname = socket.gethostname().split(".")[0]

    def env(self, **extra: str) -> dict[str, str]:
        """The environment for the cluster's commands (and, through sbatch, for its jobs)."""
        return {**self.environment, "SLURM_CONF": str(self.conf), MARKER: str(self.root), **extra}

    def run(self, *command: str, **extra: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            command, env=self.env(**extra), capture_output=True, text=True, timeout=60, check=False
        )

    # ------------------------------------------------------------------ start and stop

    def start(self) -> LocalSlurm:
        self.reaper = subprocess.Popen(  # in a session of its own: a signal to the test's group spares it
            [sys.executable, slurm_reaper.__file__, str(self.root), str(os.getpid())],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,  # not the test's: pytest-xdist talks to its workers through theirs
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        for name in ("state", "log", "munge", *(f"spool/{n}" for n in NODES)):
            (self.root / name).mkdir(parents=True, exist_ok=True)
        (self.root / "munge").chmod(0o700)
        key = self.root / "munge" / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o600)
        self.conf.write_text(self._config())
        munge = self.root / "munge"
        self._daemon(
            "munged",
            ["munged", "--foreground", "--force", f"--socket={munge / 'socket'}", f"--key-file={key}"]
            + [f"--log-file={munge / 'log'}", f"--pid-file={munge / 'pid'}", f"--seed-file={munge / 'seed'}"],
        )
        self._wait_for(lambda: (munge / "socket").exists(), "munged's socket", 10)
        self._daemon("slurmctld", ["slurmctld", "-D", "-i"])
        for node in NODES:
            self._daemon(f"slurmd-{node}", ["slurmd", "-D", "-N", node])
        self._wait_for(self._nodes_idle, "every node idle in sinfo", 30)
        return self

    def _config(self) -> str:
        root, host = self.root, self.hostname
        cpus = os.cpu_count() or 1
        nodes = "\n".join(
            f"NodeName={node} NodeHostname={host} NodeAddr=127.0.0.1 Port={free_port()} CPUs={cpus} "
            "State=UNKNOWN"
            for node in NODES
        )
        return f"""\
ClusterName=litoffpolicy
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort={free_port()}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
# cred_expire: a requeued job waits this long before it may start again (default 120 s, minimum 5)
AuthInfo=socket={root}/munge/socket,cred_expire=5
CommunicationParameters=NoCtldInAddrAny,NoInAddrAny
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool/%n
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd-%n.pid
SlurmctldLogFile={root}/log/slurmctld.log
SlurmdLogFile={root}/log/slurmd-%n.log
FirstJobId={first_job_id()}
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/builtin
SchedulerParameters=sched_interval=1
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/filetxt
JobCompLoc={self.jobcomp}
ReturnToService=2
KillWait=30
MinJobAge=600
{nodes}
PartitionName=local Nodes={",".join(NODES)} Default=YES MaxTime=INFINITE State=UP
"""

    def _daemon(self, name: str, command: list[str]) -> None:
        log = open(self.root / "log" / f"{name}.out", "wb")  # noqa: SIM115 - closed with the process
        process = subprocess.Popen(
            command, env=self.env(), stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        log.close()
        self.daemons[name] = process

    def _nodes_idle(self) -> bool:
        for name, process in self.daemons.items():
            if process.poll() is not None:
                raise RuntimeError(f"{name} exited with {process.returncode}:\n{self.logs()}")
        states = self.run("sinfo", "--noheader", "--Node", "--format=%N %t").stdout.split()
        return states.count("idle") == len(NODES)

    def _wait_for(self, condition, what: str, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while not condition():
            if time.monotonic() > deadline:
                raise RuntimeError(f"local SLURM: no {what} within {seconds} s:\n{self.logs()}")
            time.sleep(0.2)

    def logs(self, tail: int = 3000) -> str:
        return "\n".join(
            f"--- {path.name}\n{path.read_text(errors='replace')[-tail:]}"
            for path in sorted((self.root / "log").glob("*"))
        )

    def stop(self) -> None:
        """Cancel every job, stop the daemons, kill what is left of the jobs, remove the directory."""
        try:
            if "slurmctld" in self.daemons and self.daemons["slurmctld"].poll() is None:
                self.run("scancel", "--full", "--quiet", "--user", str(os.getuid()))
                deadline = time.monotonic() + 40
                while self.run("squeue", "--noheader").stdout.strip() and time.monotonic() < deadline:
                    time.sleep(0.5)
        finally:
            for process in reversed(self.daemons.values()):  # slurmd, slurmctld, then munged
                if process.poll() is None:
                    process.terminate()
            for process in self.daemons.values():
                try:
                    process.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait()
            slurm_reaper.kill_cluster(str(self.root))
            shutil.rmtree(self.root, ignore_errors=True)
            if self.reaper is not None:
                self.reaper.kill()
                self.reaper.wait()

    # ------------------------------------------------------------------ jobs

    def sbatch(self, *args: str, **env: str) -> int:
        result = self.run("sbatch", "--parsable", *args, **env)
        if result.returncode != 0:
            raise RuntimeError(f"sbatch {' '.join(args)}: {result.stderr.strip()}")
        return int(result.stdout.strip().split(";")[0])

    def job(self, job_id: int) -> dict[str, str]:
        """``scontrol show job`` as a dict (JobState, Restarts, ExitCode, NodeList, ...)."""
        result = self.run("scontrol", "show", "job", "--oneliner", str(job_id))
        if result.returncode != 0:
            raise RuntimeError(f"scontrol show job {job_id}: {result.stderr.strip()}")
        return dict(re.findall(r"(\w+)=(\S*)", result.stdout))

    def wait_until_ended(self, job_id: int, seconds: float) -> dict[str, str]:
        """The job's record once it ended and all its processes are gone (not COMPLETING any more)."""
        deadline = time.monotonic() + seconds
        while True:
            job = self.job(job_id)
            if job["JobState"] in ENDED:
                return job
            if time.monotonic() > deadline:
                raise TimeoutError(f"job {job_id} still {job['JobState']} after {seconds} s:\n{self.logs()}")
            time.sleep(0.5)

    processes_with = staticmethod(slurm_reaper.processes_with)
