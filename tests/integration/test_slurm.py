"""configs/slurm/rl.sbatch on a real SLURM cluster: DDP over two nodes, preemption with requeue and
resume, ``scancel``.

Real parts: Debian's slurm-wlm (slurmctld, two slurmd on this host, MUNGE), ``sbatch``, ``srun``,
``scancel`` and ``scontrol requeue``; the CLI in every task, Lightning's DDP over gloo, the tiny
Llama. Overridden for a CPU machine: ``--gpus-per-node=0``, one CPU per task, a strategy file that
sets ``accelerator: cpu`` (gloo). The cluster (tests/helpers/slurm_cluster.py) runs whenever
``slurmctld`` is installed (``.ci/run`` installs it); without it these tests skip, or fail when ``CI``
is set.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from types import SimpleNamespace

import lightning as L
import pytest
import torch
import yaml
from helpers import PYTHONPATH, REPO, subprocess_env
from helpers.slurm_cluster import MARKER, LocalSlurm, free_port, missing_commands

from lit_offpolicy.models import load_actor

MAX_STEPS = 5
STEP_SECONDS = 0.5  # a pause at each step start, so that a signal lands mid-run
SIGNAL_AT_STEP = 2  # the preempted job's first incarnation waits at this step's start for the signal
SRUN_TASK_END = r"srun: error: \S+: tasks? ([\d,-]+): (?:Exited with exit code )?(\w+)"


class RankSteps(L.Callback):
    """Per rank: one JSON line per finished step (step, policy version, prompts, job incarnation, node)
    in ``steps-rank{r}.jsonl``; the actor in ``final-rank{r}.pt`` at the end of training.

    ``wait_for_signal``: the job's first incarnation waits at the start of step ``SIGNAL_AT_STEP`` until
    the rank's ``PreemptionCheckpoint`` has the signal, so that it lands mid-run however slow the
    machine (the signal was once late on a loaded one: the job had ended)."""

    def __init__(self, dirpath: str, seconds: float = 0.0, wait_for_signal: bool = False) -> None:
        self.dirpath, self.seconds, self.wait_for_signal = Path(dirpath), seconds, wait_for_signal

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        time.sleep(self.seconds)
        first_incarnation = os.environ.get("SLURM_RESTART_COUNT", "0") == "0"
        if self.wait_for_signal and first_incarnation and trainer.global_step + 1 == SIGNAL_AT_STEP:
            deadline = time.monotonic() + 120
            while not any(getattr(c, "requested_by", None) for c in trainer.callbacks):
                assert time.monotonic() < deadline, f"no signal at step {SIGNAL_AT_STEP} within 120 s"
                time.sleep(0.05)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        row = {
            "step": trainer.global_step,
            "version": pl_module.policy_version,
            "prompts": list(batch["prompt"]),
            "restarts": int(os.environ.get("SLURM_RESTART_COUNT", "0")),
            "node": os.environ.get("SLURMD_NODENAME"),
            "world_size": trainer.world_size,
        }
        with open(self.dirpath / f"steps-rank{trainer.global_rank}.jsonl", "a") as file:
            file.write(json.dumps(row) + "\n")

    def on_train_end(self, trainer, pl_module):
        actor = {k: v.detach().clone() for k, v in pl_module.actor.state_dict().items()}
        torch.save(actor, self.dirpath / f"final-rank{trainer.global_rank}.pt")


@pytest.fixture(scope="module")
def slurm_installed() -> None:
    """Skips the test where SLURM cannot run here; fails it instead where ``CI`` is set."""
    missing = missing_commands()
    if missing:
        cannot = f"SLURM is not installed (no {', '.join(missing)}): apt-get install -y slurm-wlm"
    elif os.geteuid() != 0:
        cannot = "the local SLURM cluster needs root: slurmd starts each job as its user"
    if missing or os.geteuid() != 0:
        if os.environ.get("CI"):
            pytest.fail(f"{cannot}; CI must run these tests (.ci/run installs slurm-wlm)", pytrace=False)
        pytest.skip(cannot)


@pytest.fixture(scope="module")
def slurm(slurm_installed, tmp_path_factory):
    # the session's environment as it began: in-process engines and fits change os.environ
    cluster = LocalSlurm(tmp_path_factory.mktemp("slurm"), subprocess_env())
    try:
        yield cluster.start()
    finally:
        cluster.stop()


def write_run(root: Path, model_dir: str, wait_for_signal: bool = False) -> dict[str, str]:
    """The RL config and the CPU strategy file for ``rl.sbatch``; returns its variables."""
    root.mkdir(parents=True)
    rollout = {
        "sampling": {"n": 2, "max_tokens": 4},
        "reward": {"fn": {"class_path": "helpers.HashReward"}},  # in a worker process, the default
        "validation": {"every_n_steps": 0},
        "log_samples_every_n_steps": 0,
    }
    config = {
        "seed_everything": 0,
        "trainer": {
            "max_steps": MAX_STEPS,
            "logger": False,
            "enable_progress_bar": False,
            "enable_model_summary": False,
            "limit_val_batches": 0,
            "num_sanity_val_steps": 0,
            "callbacks": [
                {"class_path": "lit_offpolicy.callbacks.Rollout", "init_args": rollout},
                {
                    "class_path": f"{__name__}.RankSteps",
                    "init_args": {
                        "dirpath": str(root),
                        "seconds": STEP_SECONDS,
                        "wait_for_signal": wait_for_signal,
                    },
                },
                {  # no periodic checkpoint: a last.ckpt is the signal's
                    "class_path": "lightning.pytorch.callbacks.ModelCheckpoint",
                    "init_args": {"dirpath": str(root / "checkpoints"), "save_last": True},
                },
            ],
        },
        "model": {
            "class_path": "lit_offpolicy.OffPolicyModule",
            "init_args": {"model_path": model_dir, "optim": {"lr": 1.0e-3}},
        },
        "data": {"batch_size": 2, "num_val_samples": 8},
    }
    strategy = {
        "accelerator": "cpu",
        "strategy": {
            "class_path": "lightning.pytorch.strategies.DDPStrategy",
            "init_args": {"process_group_backend": "gloo"},
        },
    }
    (root / "rl.yaml").write_text(yaml.safe_dump(config))
    (root / "cpu_ddp.yaml").write_text(yaml.safe_dump(strategy))
    return {"CONFIG": str(root / "rl.yaml"), "STRATEGY": str(root / "cpu_ddp.yaml"), "RUN_DIR": str(root)}


def submit(
    slurm: LocalSlurm, root: Path, model_dir: str, nodes: int, tasks_per_node: int, wait_for_signal=False
) -> int:
    """``sbatch configs/slurm/rl.sbatch`` with CPU overrides; the job log is ``root/job.out``."""
    variables = write_run(root, model_dir, wait_for_signal)
    return slurm.sbatch(
        f"--nodes={nodes}",
        f"--ntasks-per-node={tasks_per_node}",
        "--gpus-per-node=0",
        "--cpus-per-task=1",
        "--time=5",
        f"--chdir={root}",
        f"--output={root / 'job.out'}",
        str(REPO / "configs" / "slurm" / "rl.sbatch"),
        PATH=f"{Path(sys.executable).parent}:{os.environ['PATH']}",
        PYTHONPATH=PYTHONPATH,
        **variables,
    )


def steps(root: Path, rank: int) -> list[dict]:
    path = root / f"steps-rank{rank}.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def wait_for_step(slurm: LocalSlurm, job_id: int, root: Path, step: int, seconds: float = 90) -> None:
    deadline = time.monotonic() + seconds
    while not any(row["step"] >= step for row in steps(root, 0)):
        state = slurm.job(job_id)["JobState"]
        assert state in ("PENDING", "RUNNING"), f"job {job_id} {state}:\n{log_of(root)}"
        assert time.monotonic() < deadline, f"no step {step} within {seconds} s:\n{log_of(root)}"
        time.sleep(0.2)


def log_of(root: Path) -> str:
    """The job's whole log (both parts of a requeued job: ``--open-mode=append``)."""
    path = root / "job.out"
    return path.read_text(errors="replace") if path.exists() else "(no job log)"


def task_ends(log: str) -> dict[int, str]:
    """How srun saw each task end, from its lines ``srun: error: node1: tasks 0-1: Exited with exit
    code 143`` (or ``task 1: Terminated``): the exit status, or how the task was ended."""
    ends = {}
    for tasks, end in re.findall(SRUN_TASK_END, log):
        for part in tasks.split(","):
            first, _, last = part.partition("-")
            for task in range(int(first), int(last or first) + 1):
                ends[task] = end
    return ends


def saved_step(path: Path) -> int:
    return torch.load(path, map_location="cpu", weights_only=True)["global_step"]


@pytest.fixture(scope="module")
def runs(slurm, tiny_model_dir, tmp_path_factory) -> SimpleNamespace:
    """Two jobs of 2 nodes x 1 task side by side (each node has a CPU for each): one uninterrupted,
    one sent SIGUSR1 by the controller after its first step (``scancel --signal=USR1``, what
    ``--signal=USR1@90`` sends 90 s before the time limit). Returns their directories, job ids and
    final ``scontrol`` records."""
    base = tmp_path_factory.mktemp("slurm-runs")
    whole, preempted = base / "whole", base / "preempted"
    ids = {
        root: submit(
            slurm, root, tiny_model_dir, nodes=2, tasks_per_node=1, wait_for_signal=root == preempted
        )
        for root in (whole, preempted)
    }
    wait_for_step(slurm, ids[preempted], preempted, step=SIGNAL_AT_STEP - 1)
    assert slurm.run("scancel", "--signal=USR1", str(ids[preempted])).returncode == 0
    jobs = {root: slurm.wait_until_ended(job_id, 240) for root, job_id in ids.items()}
    return SimpleNamespace(
        whole=whole,
        preempted=preempted,
        preempted_id=ids[preempted],
        job=jobs[preempted],
        whole_job=jobs[whole],
    )


@pytest.mark.slow
def test_sbatch_trains_with_ddp_over_two_nodes_with_equal_weights(runs, tiny_model_dir):
    whole = runs.whole
    assert (runs.whole_job["JobState"], runs.whole_job["ExitCode"]) == ("COMPLETED", "0:0"), log_of(whole)
    ranks = [steps(whole, 0), steps(whole, 1)]
    for rank, rows in enumerate(ranks):
        assert [r["step"] for r in rows] == list(range(1, MAX_STEPS + 1))
        assert [r["version"] for r in rows] == list(range(1, MAX_STEPS + 1))
        assert {(r["node"], r["world_size"]) for r in rows} == {(f"node{rank + 1}", 2)}, "a task per node"
    for row0, row1 in zip(*ranks, strict=True):
        assert not set(row0["prompts"]) & set(row1["prompts"]), "each rank trains on its own prompts"
    final = [torch.load(whole / f"final-rank{r}.pt", weights_only=True) for r in (0, 1)]
    initial = load_actor(tiny_model_dir).state_dict()
    for name, tensor in final[0].items():
        assert torch.equal(tensor, final[1][name]), name
    assert any(not torch.equal(final[0][n], t) for n, t in initial.items()), "training moved the weights"
    assert "Starting with 2 processes" in log_of(whole)


@pytest.mark.slow
def test_preempted_job_requeues_and_resumes_as_the_uninterrupted_run(runs):
    """SIGUSR1 to every task: the step in flight finishes, both ranks save ``last.ckpt``, rank 0
    requeues the job; the requeued job resumes from it and ends as the uninterrupted one."""
    root, whole, job, job_id = runs.preempted, runs.whole, runs.job, runs.preempted_id
    log = log_of(root)
    assert (job["JobState"], job["ExitCode"], job["Restarts"]) == ("COMPLETED", "0:0", "1"), log
    assert f"requeued SLURM job {job_id}" in log
    # 128 + SIGUSR1; or the SIGTERM that the requeue sends, when it reaches a task after its handlers
    # were given back at teardown (after the save, as the task was ending anyway)
    assert set(task_ends(log)) == {0, 1} and set(task_ends(log).values()) <= {"138", "Terminated"}, log
    assert f"Restoring states from the checkpoint path at {root / 'checkpoints' / 'last.ckpt'}" in log
    for rank in (0, 1):
        rows, expected = steps(root, rank), steps(whole, rank)
        first = [r for r in rows if r["restarts"] == 0]
        resumed = [r for r in rows if r["restarts"] == 1]
        assert first and resumed, log
        assert [r["step"] for r in first + resumed] == list(range(1, MAX_STEPS + 1)), "none lost or twice"
        assert [r["prompts"] for r in rows] == [r["prompts"] for r in expected], "the same prompt stream"
    final = [torch.load(root / f"final-rank{r}.pt", weights_only=True) for r in (0, 1)]
    expected = torch.load(whole / "final-rank0.pt", weights_only=True)
    # the resumed job repeats the uninterrupted job's float32 operations on the same inputs: equal to the
    # bit; 1e-6 (≈ 10 ulps of weights ≤ 1) absorbs last bits only, far below an AdamW step
    for name, tensor in expected.items():
        assert torch.equal(final[0][name], final[1][name]), name
        assert torch.allclose(final[0][name], tensor, atol=1e-6, rtol=0), name
    assert not list((root / "checkpoints").glob("last-v*.ckpt")), "the resumed run saves over last.ckpt"
    assert saved_step(root / "checkpoints" / "last.ckpt") == MAX_STEPS


# ---------------------------------------------------------------------- rollout servers (rl_servers.sbatch)


class ServerSteps(L.Callback):
    """Per rank: one JSON line per finished step in ``steps-rank{r}.jsonl``: step, the version that
    sampled it, the servers alive, the node, the job's incarnation and the step's prompts."""

    def __init__(self, dirpath: str) -> None:
        self.dirpath = Path(dirpath)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        row = {
            "step": trainer.global_step,
            "sampled_by": int(batch["experience"].policy_versions.max()),
            "servers_alive": trainer.callback_metrics["rollout/servers_alive"].item(),
            "node": os.environ.get("SLURMD_NODENAME"),
            "restarts": int(os.environ.get("SLURM_RESTART_COUNT", "0")),
            "prompts": list(batch["prompt"]),
        }
        with open(self.dirpath / f"steps-rank{trainer.global_rank}.jsonl", "a") as file:
            file.write(json.dumps(row) + "\n")


REQUEUING = ("PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "REQUEUED")
"""The states a job passes through while it runs, is requeued and starts again."""


def wait_for_incarnation(slurm: LocalSlurm, job_id: int, root: Path, restarts: int, step: int) -> None:
    """Until both ranks have finished ``step`` in the job's ``restarts``-th incarnation (rank 0 may write a
    step's row before rank 1 writes its own: the ranks meet only in the step's collectives)."""
    deadline = time.monotonic() + 300

    def reached(rank: int) -> bool:
        return any(r["restarts"] == restarts and r["step"] >= step for r in steps(root, rank))

    while not (reached(0) and reached(1)):
        state = slurm.job(job_id)["JobState"]
        assert state in REQUEUING, f"job {job_id} {state}:\n{log_of(root)}"
        assert time.monotonic() < deadline, f"no step {step} of incarnation {restarts}:\n{log_of(root)}"
        time.sleep(0.5)


@pytest.mark.slow
def test_rl_servers_sbatch_trains_two_ranks_beside_a_server_node_requeues_and_scancel_leaves_no_vllm(
    slurm, tiny_model_dir, tmp_path
):
    """configs/slurm/rl_servers.sbatch on 3 nodes: a CPU vLLM server on node1, a DDP trainer rank on
    each of node2 and node3, the URLs handed over by the script; each step samples, on both ranks,
    with the weights pushed after the one before, each rank its own prompts. SIGUSR1 (SLURM's warning
    before a preemption, sent to every step of the job, the server's too): the step finishes, last.ckpt
    is saved, the job requeues, its server starts again and the ranks resume with the versions where
    they were. ``scancel`` then (SIGTERM to every task): both ranks finish their step, last.ckpt holds
    it whole, they exit 143, and no process of the job is left on any node, vLLM's included."""
    root = tmp_path / "servers"
    root.mkdir()
    rollout = {
        "engine": "hf",  # replaced by the script's --rollout.engine (the servers' URLs)
        "sampling": {"n": 2, "max_tokens": 4, "seed": 0},
        "reward": {"fn": {"class_path": "helpers.HashReward"}},
        "validation": {"every_n_steps": 0},
        "log_samples_every_n_steps": 0,
    }
    config = {
        "seed_everything": 0,
        "trainer": {
            "max_steps": 100,
            "logger": False,
            "enable_progress_bar": False,
            "callbacks": [  # a step's row is written before Rollout's push after it, which may fail
                {"class_path": f"{__name__}.ServerSteps", "init_args": {"dirpath": str(root)}},
                {"class_path": "lit_offpolicy.callbacks.Rollout", "init_args": rollout},
            ],
        },
        "model": {"class_path": "lit_offpolicy.OffPolicyModule", "init_args": {"optim": {"lr": 1.0e-3}}},
        "data": {"batch_size": 2, "num_val_samples": 8},
    }
    (root / "rl.yaml").write_text(yaml.safe_dump(config))
    job_id = slurm.sbatch(
        "--nodes=3",
        "--gpus-per-node=0",
        "--cpus-per-task=1",
        "--time=10",
        f"--chdir={root}",
        f"--output={root / 'job.out'}",
        str(REPO / "configs" / "slurm" / "rl_servers.sbatch"),
        PATH=f"{Path(sys.executable).parent}:{os.environ['PATH']}",
        PYTHONPATH=PYTHONPATH,
        CONFIG=str(root / "rl.yaml"),
        ROLLOUT="",
        STRATEGY="",  # the config's own trainer: Lightning's DDP on the CPU
        MODEL=tiny_model_dir,
        TRAINER_NODES="2",
        SERVER_PORT=str(free_port()),
        SERVER_ARGS="--dtype float32 --enforce-eager --max-model-len 64",
        RUN_DIR=str(root),
        VLLM_CPU_KVCACHE_SPACE="1",
    )
    wait_for_incarnation(slurm, job_id, root, restarts=0, step=2)
    assert slurm.run("scancel", "--signal=USR1", str(job_id)).returncode == 0
    wait_for_incarnation(slurm, job_id, root, restarts=1, step=max(r["step"] for r in steps(root, 0)) + 2)
    log = log_of(root)
    assert "rl_servers.sbatch: servers on node1" in log and "trainer on node2 node3" in log, log
    assert f"requeued SLURM job {job_id}" in log, log
    ranks = [steps(root, 0), steps(root, 1)]
    for rank, rows in enumerate(ranks):
        done = min(len(ranks[0]), len(ranks[1]))
        assert [row["step"] for row in rows[:done]] == list(range(1, done + 1)), "none lost or twice"
        assert {row["restarts"] for row in rows} == {0, 1}, "steps before and after the requeue"
        assert all(row["sampled_by"] == row["step"] - 1 for row in rows), "sampled after the last push"
        assert {(row["node"], row["servers_alive"]) for row in rows} == {(f"node{rank + 2}", 1.0)}
    for row0, row1 in zip(*ranks, strict=False):  # rank 1 may have a step more
        assert not set(row0["prompts"]) & set(row1["prompts"]), "each rank samples its own prompts"
    # scancel: SIGTERM to every task; the trainer's step in flight finishes, last.ckpt is saved whole
    assert slurm.run("scancel", str(job_id)).returncode == 0
    job = slurm.wait_until_ended(job_id, 90)
    log = log_of(root)
    assert job["JobState"] == "CANCELLED", log
    trainer_ends = dict(
        re.findall(r"srun: error: (node[23]): task \d+: (?:Exited with exit code )?(\w+)", log)
    )
    assert trainer_ends == {"node2": "143", "node3": "143"}, (
        log
    )  # the last end of each rank: saved, then ended
    last = root / "checkpoints" / "last.ckpt"
    assert saved_step(last) == steps(root, 0)[-1]["step"], "the last finished step is in last.ckpt"
    assert not list((root / "checkpoints").glob("*.tmp")), "no partial write left"
    deadline = time.monotonic() + 30
    while LocalSlurm.processes_with(f"SLURM_JOB_ID={job_id}") and time.monotonic() < deadline:
        time.sleep(0.5)
    assert LocalSlurm.processes_with(f"SLURM_JOB_ID={job_id}") == [], "a process of the job is left"


# a test process that starts its own cluster (argv[1]) and a job that sleeps, says so, and waits to be killed
OWNER = textwrap.dedent(
    """
    import os, sys, time
    from pathlib import Path
    from helpers.slurm_cluster import LocalSlurm
    root = Path(sys.argv[1])
    cluster = LocalSlurm(root, dict(os.environ)).start()
    job = cluster.sbatch("--wrap", "sleep 600", f"--chdir={root}", f"--output={root / 'job.out'}")
    deadline = time.monotonic() + 60
    while cluster.job(job)["JobState"] != "RUNNING" and time.monotonic() < deadline:
        time.sleep(0.2)
    state = cluster.job(job)
    print(state["JobState"], state.get("Reason"), flush=True)
    time.sleep(600)
    """
)


def test_a_cluster_whose_test_process_is_killed_leaves_no_process(slurm_installed, tmp_path):
    """The test process that started a local cluster is SIGKILLed with a job submitted, as pytest-xdist
    ends its workers on Ctrl-C (no ``stop()``): the cluster's reaper kills the daemons and the job's
    processes (each in a session of its own, out of the group's reach) and removes the directory.
    The job runs within seconds alone; beside the suite in a slow hour SLURM twice left it pending
    (once held, ``launch_failed_requeued_held``), so the daemons are what the test requires to be
    there; the job's processes, where it runs, are reaped by the same marker."""
    root = tmp_path / "cluster"
    owner = subprocess.Popen(
        [sys.executable, "-c", OWNER, str(root)], env=subprocess_env(), stdout=subprocess.PIPE, text=True
    )
    try:
        state = owner.stdout.readline().strip()  # the job's state, then SLURM's reason
        marked = LocalSlurm.processes_with(f"{MARKER}={root}")
        running = 6 if state.startswith("RUNNING") else 5  # the job's slurmstepd and shell, where it runs
        assert len(marked) >= running, (state, marked)  # munged, slurmctld, 3 slurmd
    finally:
        owner.kill()
        owner.wait()
    deadline = time.monotonic() + 30
    while (LocalSlurm.processes_with(f"{MARKER}={root}") or root.exists()) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert LocalSlurm.processes_with(f"{MARKER}={root}") == [], "a process of the cluster outlived its test"
    assert not root.exists(), "the reaper removes the cluster's directory after its processes"
