"""The rollout-server configs through the CLI on the tiny model: configs/rollout/vllm_server.yaml
(synchronous) and configs/rollout/vllm_server_async.yaml (AsyncRollout with in-flight updates), with
real ``vllm serve`` processes; and the servers' life tied to the run's: a run that ends, or is SIGTERMed
as a process group, leaves no process of theirs. (A SIGKILLed trainer: its watchdogs end the servers by
the same path as a SIGTERM, tests/rollout/test_server_parts.py.)"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import lightning as L
import psutil
import pytest
import torch
import yaml
from helpers import CONFIGS, REPO, subprocess_env
from helpers.cli_runs import (
    HASH_REWARD,
    fit_fails_with_one_line,
    fit_fails_with_one_line_and_stderr,
    read_metrics,
    redirect,
    small_fit_args,
)

from lit_offpolicy.callbacks import Rollout
from lit_offpolicy.cli import main
from lit_offpolicy.rollout import VLLMServerSpec
from lit_offpolicy.rollout.server import supervise

pytestmark = pytest.mark.slow


def server_callbacks(config: str, out: Path, every_step_checkpoint: bool = False) -> list[dict]:
    """The callbacks of ``configs/rollout/<config>.yaml``: hash reward, outputs under ``out``."""
    callbacks = yaml.safe_load((CONFIGS / "rollout" / f"{config}.yaml").read_text())["trainer"]["callbacks"]
    for callback in callbacks:
        init_args = callback["init_args"]
        if callback["class_path"].endswith("Rollout"):
            init_args["reward"] = HASH_REWARD
        if "dirpath" in init_args:
            init_args["dirpath"] = redirect(init_args["dirpath"], out)
        if every_step_checkpoint and "every_n_train_steps" in init_args:
            init_args["every_n_train_steps"] = 1
    return callbacks


def descendants(pid: int) -> list[psutil.Process]:
    return psutil.Process(pid).children(recursive=True)


def all_end(processes: list[psutil.Process], timeout: float) -> list[str]:
    """What of ``processes`` still runs after ``timeout`` seconds (zombies have ended)."""
    deadline = time.monotonic() + timeout
    while True:
        running = []
        for process in processes:
            try:
                if process.status() != psutil.STATUS_ZOMBIE:
                    running.append(" ".join(process.cmdline()[:4]))
            except psutil.NoSuchProcess:
                pass
        if not running or time.monotonic() > deadline:
            return running
        time.sleep(0.2)


class KillServers(L.Callback):
    """After step 1's weight push and evaluation: SIGKILL server 0's watchdog (its server gets SIGTERM as
    the watchdog dies) and wait until the run has lost it. After step 2's: SIGKILL every API server left
    (their machines lost). Every process of the servers (watchdog, API server, engine core, workers) is
    kept in ``KillServers.processes`` first: those the run must leave none of (found by the tree, not by
    name, so that another pytest-xdist worker's servers do not count)."""

    processes: list[psutil.Process] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        (rollout,) = [c for c in trainer.callbacks if isinstance(c, Rollout)]
        servers = rollout.worker.engine.pool.servers
        if pl_module.policy_version == 1:
            for server in servers:
                watchdog = psutil.Process(server.launched.process.pid)
                KillServers.processes += [watchdog, *descendants(watchdog.pid)]
            psutil.Process(servers[0].launched.process.pid).kill()
            deadline = time.monotonic() + 60
            while servers[0].alive:
                assert time.monotonic() < deadline, "server 0 was not lost within 60 s of its watchdog's end"
                time.sleep(0.2)
        if pl_module.policy_version == 2:
            for server in rollout.worker.engine.pool.alive:
                for api_server in psutil.Process(server.launched.process.pid).children():
                    api_server.kill()


def test_grpo_on_two_launched_servers_trains_on_the_one_left_then_stops_when_both_are_lost(
    tiny_model_dir, tmp_path, capsys
):
    """configs/grpo.yaml + configs/rollout/vllm_server.yaml, with two-turn episodes and an evaluation
    every 2 steps: each step samples on the servers the weights pushed after the previous one, and
    π_rollout matches the trainer's recompute. After step 1 server 0's watchdog is SIGKILLed: the run
    loses that server (one warning) and step 2 runs on server 1. After step 2 server 1 is SIGKILLed:
    step 3 saves last.ckpt and ends the run with one line (exit 2), and no server process is left."""
    KillServers.processes = []
    callbacks = server_callbacks("vllm_server", tmp_path, every_step_checkpoint=True)
    callbacks[0]["init_args"].update(
        validation={"every_n_steps": 2},
        episodes={
            "environment": {"class_path": "helpers.episodes.CountdownEnvironment", "init_args": {"turns": 2}},
            "max_turns": 3,
            "max_response_tokens": 64,
        },
    )
    callbacks.append({"class_path": f"{__name__}.KillServers"})
    args = small_fit_args("grpo", tiny_model_dir, tmp_path, 3, callbacks)
    line, err = fit_fails_with_one_line_and_stderr(args, capsys)
    last = tmp_path / "checkpoints" / "last.ckpt"
    assert "all 2 rollout servers are lost (http://127.0.0.1:" in line and f"saved {last}" in line, line
    assert saved_step(last) == 2
    assert len(KillServers.processes) >= 6, "the servers' processes were not found: a vacuous check"
    assert all_end(KillServers.processes, timeout=15) == [], "a server process outlived the run"
    first_loss = next(line for line in err.splitlines() if "is lost" in line)
    assert "its requests go to the 1 server(s) left" in first_loss, first_loss

    rows = read_metrics(tmp_path / "logs")
    assert [float(row["val/accuracy"]) >= 0 for row in rows if row.get("val/accuracy")] == [True] * 2
    train_rows = [row for row in rows if row.get("actor/pg_loss")]
    assert len(train_rows) == 2
    assert all(float(row["env/turns_mean"]) == 2.0 for row in train_rows), "two turns, each on the servers"
    assert [float(row["rollout/policy_version"]) for row in train_rows] == [0.0, 1.0]
    assert [float(row["rollout/servers_alive"]) for row in train_rows] == [2.0, 1.0]
    # π_rollout of the servers against the trainer's π_old, same weights, float32: each token's log-ratio
    # is within 1e-4 (tests/integration/test_rollout_servers.py), so is their mean, kl
    for row in train_rows:
        assert abs(float(row["rollout_corr/kl"])) < 1e-4, row["rollout_corr/kl"]
    assert float(train_rows[-1]["actor/grad_norm"]) > 0, "no gradient: the pushes would change nothing"
    logs = list((tmp_path / "logs").glob("grpo/version_*/vllm_server*.log"))
    assert len(logs) == 2, "each server's log is in the run's log directory"


def cli(model_dir: str, out: Path, rollout: str) -> subprocess.Popen:
    """``lit-offpolicy fit`` of configs/grpo.yaml with configs/rollout/<rollout>.yaml's callbacks, 50
    steps and a checkpoint every step, as the leader of a new process group."""
    args = [
        *("fit", "--config", str(CONFIGS / "grpo.yaml"), "--model.init_args.model_path", model_dir),
        *("--trainer.max_steps", "50", "--trainer.logger", "false", "--trainer.enable_progress_bar", "false"),
        *("--trainer.default_root_dir", str(out)),  # where the CLI saves config.yaml
        *("--trainer.callbacks", json.dumps(server_callbacks(rollout, out, every_step_checkpoint=True))),
        *("--data.batch_size", "4", "--data.num_val_samples", "8"),
    ]
    return subprocess.Popen(
        [sys.executable, "-m", "lit_offpolicy", *args],
        env=subprocess_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )


def output_or_stacks(process: subprocess.Popen, timeout: float) -> str:
    """The run's output once it exits within ``timeout``; otherwise a failure showing its last output
    and every thread's stack (the CLI prints them on SIGUSR2: ``core.stacks``)."""
    try:
        return process.communicate(timeout=timeout)[0]
    except subprocess.TimeoutExpired:
        process.send_signal(signal.SIGUSR2)
        time.sleep(3)
        process.kill()
        output = process.communicate()[0]
        pytest.fail(f"the run did not exit within {timeout:.0f} s; its output and stacks:\n{output[-8000:]}")


def saved_step(path: Path) -> int:
    if not path.is_file():
        return -1
    return torch.load(path, map_location="cpu", weights_only=True)["global_step"]


def wait_for_step(
    process: subprocess.Popen, last: Path, step: int, timeout: float = 240
) -> list[psutil.Process]:
    """Wait until ``last`` holds ``step``; the run's processes then (the servers among them)."""
    deadline = time.monotonic() + timeout
    while saved_step(last) < step:
        assert process.poll() is None, process.communicate()[0][-3000:]
        assert time.monotonic() < deadline, f"no checkpoint of step {step} within {timeout} s"
        time.sleep(0.2)
    return descendants(process.pid)


def test_a_server_that_does_not_answer_ends_the_run_with_one_line_naming_it(tiny_model_dir, tmp_path, capsys):
    callbacks = server_callbacks("vllm_server", tmp_path)
    callbacks[0]["init_args"]["engine"]["init_args"] = {
        "urls": ["http://127.0.0.1:9"],
        "startup_timeout_s": 1,
    }
    line = fit_fails_with_one_line(small_fit_args("grpo", tiny_model_dir, tmp_path, 1, callbacks), capsys)
    assert "rollout server http://127.0.0.1:9 does not answer /health (waited 1 s" in line, line


def test_the_server_configs_print(capsys):
    for config in ("vllm_server", "vllm_server_async"):
        args = [
            "fit",
            "--config",
            str(CONFIGS / "grpo.yaml"),
            "--config",
            str(CONFIGS / "rollout" / f"{config}.yaml"),
        ]
        with pytest.raises(SystemExit) as exit_info:
            main([*args, "--print_config"])
        assert exit_info.value.code in (0, None)
        printed = yaml.safe_load(capsys.readouterr().out)
        (rollout,) = [c for c in printed["trainer"]["callbacks"] if c["class_path"].endswith("Rollout")]
        assert rollout["init_args"]["engine"]["class_path"] == "lit_offpolicy.rollout.VLLMServerSpec"
        assert json.dumps(rollout["init_args"]["engine"]["init_args"]["launch"]) == '{"servers": 2}'


def test_the_documented_urls_command_replaces_the_launched_servers(capsys):
    """docs/rollout_servers.md's command for servers started by hand, on top of vllm_server.yaml (whose
    engine launches 2): the engine given whole replaces the yaml's, so it is not refused as both
    ``urls`` and ``launch``."""
    engine = "{class_path: lit_offpolicy.rollout.VLLMServerSpec, init_args: {urls: [http://node7:8000]}}"
    assert f"--rollout.engine '{engine}'" in (REPO / "docs" / "rollout_servers.md").read_text()
    args = [
        "fit",
        "--config",
        str(CONFIGS / "grpo.yaml"),
        "--config",
        str(CONFIGS / "rollout" / "vllm_server.yaml"),
    ]
    with pytest.raises(SystemExit) as exit_info:
        main([*args, "--rollout.engine", engine, "--print_config"])
    assert exit_info.value.code in (0, None)
    printed = yaml.safe_load(capsys.readouterr().out)
    (rollout,) = [c for c in printed["trainer"]["callbacks"] if c["class_path"].endswith("Rollout")]
    init_args = rollout["init_args"]["engine"]["init_args"]
    assert init_args["urls"] == ["http://node7:8000"] and init_args["launch"] is None
    VLLMServerSpec(**init_args)  # what the run builds: not refused


def server_parts(run: list[psutil.Process]) -> list[dict[str, psutil.Process]]:
    """Each launched server's processes, from the run's: its watchdog, API server and engine core."""
    servers = []
    for watchdog in run:
        if watchdog.cmdline()[1:2] != [supervise.__file__]:
            continue
        (api_server,) = watchdog.children()
        # the API server's other child is multiprocessing's resource tracker
        (engine_core,) = [p for p in api_server.children() if "resource_tracker" not in " ".join(p.cmdline())]
        servers.append({"watchdog": watchdog, "api_server": api_server, "engine_core": engine_core})
    assert len(servers) == 2, [p.cmdline()[:4] for p in run]
    return servers


def test_an_async_run_survives_a_dead_engine_core_and_a_sigterm_to_its_group_leaves_last_ckpt_and_no_server(
    tiny_model_dir, tmp_path
):
    """configs/rollout/vllm_server_async.yaml, 2 launched servers. After step 1, server 0's engine core
    is SIGTERMed (what an OOM kill of it does: its API server lives on a moment and aborts what ran):
    the run goes on with server 1 to step 3. Then SIGTERM to the run's process group (a scheduler's
    preemption, ``kill -- -PGID``): the step finishes, last.ckpt is saved, exit 143, and the servers
    (in process groups of their own) end with it. (Every server lost ends the run with last.ckpt and
    exit 2: test_grpo_on_two_launched_servers_trains_on_the_one_left_then_stops_when_both_are_lost.)"""
    process = cli(tiny_model_dir, tmp_path, "vllm_server_async")
    last = tmp_path / "checkpoints" / "last.ckpt"
    try:
        run = wait_for_step(process, last, 1)
        first, _ = server_parts(run)
        first["engine_core"].terminate()
        run = list({p.pid: p for p in run + wait_for_step(process, last, 3)}.values())
        os.killpg(process.pid, signal.SIGTERM)
        output = output_or_stacks(process, timeout=120)
        assert process.returncode == 128 + signal.SIGTERM, output[-3000:]
        assert "signal received: saved" in output and "Traceback" not in output, output[-3000:]
        # (server 1 may be reported lost too: the SIGTERM reaches its watchdog while the producer samples)
        first_loss = next(line for line in output.splitlines() if "is lost" in line)
        assert "its requests go to the 1 server(s) left" in first_loss, output[-3000:]
        assert saved_step(last) >= 3
        assert all_end(run, timeout=30) == []
    finally:
        process.kill()
