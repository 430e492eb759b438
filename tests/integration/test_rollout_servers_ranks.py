"""A trainer of 2 ranks (gloo, CPU) on 2 launched vLLM servers, through the CLI as a process group:
every rank generates its own prompts on the shared servers, rank 0 pushes each version, a server lost
by one rank is lost for all, and the ranks stop together (docs/rollout_servers.md, "Several trainer
ranks"). Real processes throughout; the callbacks that record and kill are tests/helpers/server_ranks.py.
(DeepSpeed ZeRO-2/3 is not run: Lightning refuses DeepSpeed on CPU, tests/integration/test_distributed.py.)
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from helpers import CONFIGS, subprocess_env
from helpers.cli_runs import csv_logger, read_metrics

from lit_offpolicy.data import PromptDataModule
from lit_offpolicy.data.sampler import ResumableShuffleSampler
from lit_offpolicy.models import load_actor
from lit_offpolicy.training.forward import policy_log_probs
from tests.integration.test_rollout_servers_fit import (
    all_end,
    descendants,
    output_or_stacks,
    server_callbacks,
    server_parts,
)

pytestmark = pytest.mark.slow

RANKS = 2
BATCH = 4
"""Prompts per rank and step."""


def two_ranks(
    model_dir: str,
    out: Path,
    strategy: str,
    rollout: str,
    steps: int,
    *extra: str,
    kill: bool = False,
    hand_over_mid_generation: bool = False,
    await_comeback: bool = False,
    max_tokens: int | None = None,
    partial_rollouts: bool | None = None,
    rollout_options: dict | None = None,
    max_restarts: int | None = None,
    servers: int | None = None,
) -> subprocess.Popen:
    """``lit-offpolicy fit`` of configs/grpo.yaml on 2 CPU ranks under configs/strategy/<strategy>.yaml,
    with configs/rollout/<rollout>.yaml's callbacks (a checkpoint every step; ``max_tokens`` and
    ``partial_rollouts`` where given; ``servers`` launched instead of the config's 2), ``RecordRanks``,
    with ``kill`` ``KillServers``, with ``hand_over_mid_generation`` ``HandOverMidGeneration``, with
    ``await_comeback`` ``AwaitComeback``; the leader of a new process group (rank 1 is its child)."""
    callbacks = server_callbacks(rollout, out, every_step_checkpoint=True)
    if max_tokens is not None:
        callbacks[0]["init_args"]["sampling"]["max_tokens"] = max_tokens
    if partial_rollouts is not None:
        callbacks[0]["init_args"]["partial_rollouts"] = partial_rollouts
    callbacks[0]["init_args"].update(rollout_options or {})
    if max_restarts is not None:
        callbacks[0]["init_args"]["engine"]["init_args"]["max_restarts"] = max_restarts
    if servers is not None:
        callbacks[0]["init_args"]["engine"]["init_args"]["launch"]["servers"] = servers
    callbacks.append({"class_path": "helpers.server_ranks.RecordRanks", "init_args": {"out": str(out)}})
    if kill:  # before Rollout: it watches the generation that Rollout's hook starts
        callbacks.insert(0, {"class_path": "helpers.server_ranks.KillServers"})
    if hand_over_mid_generation:  # before AsyncRollout: its hook waits until the producer generates
        callbacks.insert(0, {"class_path": "helpers.server_ranks.HandOverMidGeneration"})
    if await_comeback:  # before the rollout callback: its push admits the server that is back
        callbacks.insert(0, {"class_path": "helpers.server_ranks.AwaitComeback"})
    args = [
        *("fit", "--config", str(CONFIGS / "grpo.yaml"), "--model.init_args.model_path", model_dir),
        *("--trainer", str(CONFIGS / "strategy" / f"{strategy}.yaml")),
        *("--trainer.accelerator", "cpu", "--trainer.devices", str(RANKS)),
        *("--trainer.max_steps", str(steps), "--trainer.enable_progress_bar", "false"),
        *("--trainer.logger", csv_logger(out / "logs", "grpo"), "--trainer.default_root_dir", str(out)),
        *("--trainer.callbacks", json.dumps(callbacks)),
        *("--data.batch_size", str(BATCH), "--data.num_val_samples", "8"),
        *extra,
    ]
    return subprocess.Popen(
        [sys.executable, "-m", "lit_offpolicy", *args],
        cwd=out,
        env=subprocess_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )


def kill_group(process: subprocess.Popen) -> None:
    """SIGKILL the run's process group (rank 1 and the watchdogs too), if it is still there."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)
    process.wait()


def steps_of(out: Path, rank: int) -> list[dict]:
    path = out / f"rank{rank}_steps.pt"
    return torch.load(path, weights_only=False)["steps"] if path.is_file() else []


def wait_for(process: subprocess.Popen, ready, what: str, timeout: float = 300) -> None:
    """Return once ``ready()``; past ``timeout`` the run's group is killed and its output is the error."""
    deadline = time.monotonic() + timeout
    while not ready():
        assert process.poll() is None, process.communicate()[0][-4000:]
        if time.monotonic() > deadline:
            kill_group(process)
            output = process.communicate()[0][-4000:]
            raise AssertionError(f"{what} did not happen within {timeout} s; its output ends:\n{output}")
        time.sleep(0.2)


def servers_of(process: subprocess.Popen) -> list:
    """The run's processes once its servers run: rank 1, the watchdogs, the servers and theirs."""
    run = descendants(process.pid)
    api_servers = [p for p in run if p.cmdline()[1:3] == ["-m", "vllm.entrypoints.openai.api_server"]]
    assert len(api_servers) == 2, [p.cmdline()[:4] for p in run]
    return run


def global_batches(model_dir: str, steps: int) -> list[set[str]]:
    """The prompts of each RL step over all ranks: positions [8s, 8s + 8) of epoch 0's permutation
    (configs/base/data.yaml: addition, seed 0)."""
    data = PromptDataModule(task="addition", tokenizer_path=model_dir, num_val_samples=8, seed=0)
    data.setup("fit")
    problems = data.train_problems
    order = list(iter(ResumableShuffleSampler(len(problems), seed=0)))
    width = RANKS * BATCH
    return [{problems[i]["prompt"] for i in order[s * width : (s + 1) * width]} for s in range(steps)]


def test_two_ddp_ranks_share_two_servers_go_on_when_one_is_killed_and_stop_together_when_both_are(
    tiny_model_dir, tmp_path
):
    """configs/rollout/vllm_server.yaml (sync) under DDP, with two-turn episodes and an evaluation every
    2 steps, both on the servers. Step 1 samples version 0, step 2 version 1
    (every token, on both ranks: rank 0's push ends before any rank samples), π_rollout matches the
    trainer's recompute; each rank samples its own half of the step's prompts. While step 2 generates,
    server 0's API server is SIGKILLed: both ranks go on with server 1 (one warning, servers_alive 1
    on both). After step 2's push server 1 is SIGKILLed: every rank saves last.ckpt of step 2 and the
    run ends with one line, exit 2, no process of the servers left. (``max_restarts: 0``: a lost server
    stays out; one that comes back is the FSDP2 test's.)"""
    episodes = {
        "environment": {"class_path": "helpers.episodes.CountdownEnvironment", "init_args": {"turns": 2}},
        "max_turns": 3,
        "max_response_tokens": 64,
    }
    options = {"validation": {"every_n_steps": 2}, "episodes": episodes}
    process = two_ranks(
        tiny_model_dir, tmp_path, "ddp", "vllm_server", 5, kill=True, rollout_options=options, max_restarts=0
    )
    try:
        wait_for(process, lambda: (tmp_path / "weights_v0.pt").is_file(), "the first push")
        run = servers_of(process)
        output = output_or_stacks(process, timeout=300)
    finally:
        kill_group(process)
    assert process.returncode == 2, output[-4000:]
    errors = [line for line in output.splitlines() if line.startswith("lit-offpolicy: error:")]
    last = tmp_path / "checkpoints" / "last.ckpt"
    assert len(errors) == 1 and "Traceback" not in output, output[-4000:]
    assert "all 2 rollout servers are lost" in errors[0] and f"saved {last}" in errors[0], errors[0]
    assert torch.load(last, map_location="cpu", weights_only=True)["global_step"] == 2
    assert all_end(run, timeout=30) == [], "a process of the run outlived it"
    losses = [line for line in output.splitlines() if "is lost" in line]
    assert "its requests go to the 1 server(s) left" in losses[0], output[-4000:]
    # the rank that found it lost says why, rank 0 from its own call or from rank 1's
    assert "is lost (vLLM server http" in losses[0] or "(trainer rank 1 lost it: vLLM server" in losses[0]

    metrics = read_metrics(tmp_path / "logs")
    assert [float(row["val/accuracy"]) >= 0 for row in metrics if row.get("val/accuracy")] == [True] * 2
    rows = [row for row in metrics if row.get("actor/pg_loss")]
    assert all(float(row["env/turns_mean"]) == 2.0 for row in rows), "two turns, each on the servers"
    assert [float(row["rollout/policy_version"]) for row in rows] == [0.0, 1.0]
    assert [float(row["rollout/servers_alive"]) for row in rows] == [2.0, 1.0]  # the mean over ranks
    for row in rows:  # same weights, float32 (tests/integration/test_rollout_servers.py)
        assert abs(float(row["rollout_corr/kl"])) < 1e-4, row["rollout_corr/kl"]
    ranks = [steps_of(tmp_path, rank) for rank in range(RANKS)]
    assert [len(steps) for steps in ranks] == [2, 2]
    for step, (mine, theirs, whole) in enumerate(zip(*ranks, global_batches(tiny_model_dir, 2), strict=True)):
        assert len(mine["prompts"]) == len(theirs["prompts"]) == BATCH
        assert not set(mine["prompts"]) & set(theirs["prompts"])
        assert set(mine["prompts"]) | set(theirs["prompts"]) == whole
        for record in (mine, theirs):
            experience = record["experience"]
            versions = experience.response_versions[experience.response_mask.bool()]
            assert versions.unique().tolist() == [step], "a token of another version than the one pushed"


def lost_or_back(step: dict) -> bool:
    """The step ended with one of the 2 servers lost, or after it came back (where a step outlasted
    the restart: whether one trained while it was lost is asserted at the end, not waited for)."""
    return step["servers_alive"] == 1 or step["server_restarts"] == 1


def back(step: dict) -> bool:
    """The step ended with both servers serving, one of them after a restart."""
    return step["servers_alive"] == 2 and step["server_restarts"] == 1


def spanning(steps: list[dict]) -> int:
    """How many of the recorded responses were sampled by more than one version (a push in flight)."""
    count = 0
    for record in steps:
        experience = record["experience"]
        for versions, mask in zip(experience.response_versions, experience.response_mask.bool(), strict=True):
            count += len(versions[mask].unique()) > 1
    return count


def recompute_errors(out: Path, model_dir: str, ranks: list[list[dict]]) -> tuple[float, set[int]]:
    """The largest |π_rollout − the recompute under the weights of the token's version| over every
    trained token of every rank, and the versions the tokens came from."""
    actor = load_actor(model_dir).eval()
    worst, seen = 0.0, set()
    for steps in ranks:
        for record in steps:
            experience = record["experience"]
            versions = experience.response_versions
            mask = experience.response_mask.bool()
            for version in versions[mask].unique().tolist():
                actor.load_state_dict(torch.load(out / f"weights_v{version}.pt", weights_only=True))
                with torch.no_grad():
                    recomputed, _ = policy_log_probs(actor, experience, experience.temperature)
                mine = mask & (versions == version)
                worst = max(worst, (recomputed - experience.rollout_log_probs)[mine].abs().max().item())
                seen.add(version)
    return worst, seen


def test_two_fsdp2_ranks_push_in_flight_and_a_sigtermed_group_resumes_the_versions(tiny_model_dir, tmp_path):
    """configs/rollout/vllm_server_async.yaml (AsyncRollout, partial rollouts, max_staleness 2) under
    FSDP2, responses of up to 96 tokens. Rank 0 hands each step's weights over while its producer's
    requests run (``HandOverMidGeneration``): the push lands in the middle of responses, which are
    trained two steps later. Every token's π_rollout is the recompute under the weights of the
    version the server labelled it with (1e-4). After step 2 server 0's engine core is SIGKILLed (an
    OOM kill): the run goes on with server 1 (one warning) while server 0 starts again (for 2 steps:
    ``AwaitComeback`` then waits for the restart instead of training through it); rank 0's next push
    brings it to the version, then it serves both ranks again (the recompute bound holds for its
    tokens too). SIGTERM to the process group: exit 143, last.ckpt, no process left. Resumed
    (``--ckpt_path last``, without partial rollouts, on one server), the run pushes the saved version
    and trains a step on it: the versions go on."""
    # one checkpoint file; prompts of the addition task are under 32 tokens: 32 + 96 fit the tiny model's 128
    one_file = (
        "--trainer.strategy.init_args.save_distributed_checkpoint",
        "false",
        "--data.max_prompt_length",
        "32",
    )
    options = {
        "hand_over_mid_generation": True,
        "await_comeback": True,
        "max_tokens": 96,
        "rollout_options": {"max_staleness": 2},
    }
    process = two_ranks(tiny_model_dir, tmp_path, "fsdp", "vllm_server_async", 400, *one_file, **options)
    last = tmp_path / "checkpoints" / "last.ckpt"
    try:
        wait_for(process, lambda: (tmp_path / "weights_v0.pt").is_file(), "the first push")
        run = servers_of(process)
        wait_for(process, lambda: len(steps_of(tmp_path, 1)) >= 2, "2 steps")
        # server 0's engine core ends as an OOM kill ends it: its API server lives on and aborts its requests
        server_parts(run)[0]["engine_core"].kill()
        # the loss is warned of before the SIGTERM (after it, a server that ends is no loss to warn of)
        wait_for(process, lambda: lost_or_back(steps_of(tmp_path, 0)[-1]), "server 0's loss")
        lost_at = len(steps_of(tmp_path, 1))
        # started again, pushed to by rank 0, then serving rank 1 too (the ranks agree on it)
        wait_for(process, lambda: back(steps_of(tmp_path, 1)[-1]), "server 0 back")
        back_at = len(steps_of(tmp_path, 1))
        # two steps on both servers: the batches begun after the rejoin are trained
        wait_for(process, lambda: len(steps_of(tmp_path, 1)) >= back_at + 3, "3 steps more")
        os.killpg(process.pid, signal.SIGTERM)
        output = output_or_stacks(process, timeout=120)
    finally:
        kill_group(process)
    assert process.returncode == 128 + signal.SIGTERM, output[-4000:]
    assert "signal received: saved" in output and "Traceback" not in output, output[-4000:]
    assert all_end(run, timeout=30) == [], "a process of the run outlived it"
    # server 0 only: server 1 ends with the SIGTERM (its watchdog is in the group), no loss to warn of
    losses = [line for line in output.splitlines() if "is lost" in line]
    assert len(losses) == 1 and "its requests go to the 1 server(s) left" in losses[0], output[-4000:]
    url = losses[0].split("rollout server ")[1].split()[0]
    assert f"rollout server {url} starts again (start 1 of max_restarts=5; lost: " in output, output[-4000:]
    assert output.count(f"rollout server {url} is back at version ") == 1, output[-4000:]
    saved = torch.load(last, map_location="cpu", weights_only=True)["global_step"]
    before = [steps_of(tmp_path, rank) for rank in range(RANKS)]
    assert saved >= back_at + 3 and all(len(steps) == saved for steps in before), (saved, lost_at, back_at)
    alive = [[step["servers_alive"] for step in steps] for steps in before]
    assert all(1 in counts for counts in alive), f"no step of a rank trained while server 0 was lost: {alive}"

    # resumed for one step without partial rollouts, on one server (a start fewer): it gets the saved
    # version before the step
    resumed = two_ranks(
        tiny_model_dir,
        tmp_path,
        "fsdp",
        "vllm_server_async",
        saved + 1,
        *one_file,
        "--ckpt_path",
        "last",
        max_tokens=96,
        partial_rollouts=False,
        servers=1,
    )
    output = output_or_stacks(resumed, timeout=300)
    assert resumed.returncode == 0, output[-4000:]
    after = [steps_of(tmp_path, rank)[saved:] for rank in range(RANKS)]  # RecordRanks appends
    for steps in after:
        assert [step["trainer_version"] for step in steps] == [saved]
        experience = steps[0]["experience"]
        assert experience.response_versions[experience.response_mask.bool()].min().item() == saved

    ranks = [steps_of(tmp_path, rank) for rank in range(RANKS)]
    assert sum(spanning(steps) for steps in before) > 0, "no push landed in the middle of a response"
    worst, versions = recompute_errors(tmp_path, tiny_model_dir, ranks)
    assert worst < 1e-4, worst
    # which versions between the first and the resumed one sample depends on when each push lands (once
    # {0, 1, 3, 4, 5}, 2 never); max_staleness 2 puts one in [1, saved) in the steps before the save
    assert {0, saved} <= versions and versions & set(range(1, saved)), versions
