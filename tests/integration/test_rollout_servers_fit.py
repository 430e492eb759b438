"""The rollout-server configs through the CLI on the tiny model: configs/rollout/vllm_server.yaml
(synchronous) and configs/rollout/vllm_server_async.yaml (AsyncRollout with in-flight updates), with
real ``vllm serve`` processes; and the servers' life tied to the run's: a run that ends, or is SIGTERMed
as a process group, leaves no process of theirs. (A SIGKILLed trainer: its watchdogs end the servers by
the same path as a SIGTERM, tests/rollout/test_server_parts.py. Servers lost one by one, then all,
with two-turn episodes and evaluations on them: tests/integration/test_rollout_servers_ranks.py, whose
2 ranks take every path that 1 takes, and their agreement besides.)"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch
import yaml
from helpers import CONFIGS, REPO, subprocess_env
from helpers.cli_runs import HASH_REWARD, fit_fails_with_one_line, redirect, small_fit_args

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


def test_an_async_run_survives_a_dead_engine_core_and_ctrl_c_saves_exports_and_exits_130(
    tiny_model_dir, tmp_path
):
    """configs/rollout/vllm_server_async.yaml, 2 launched servers. After step 1, server 0's engine core
    is SIGTERMed (what an OOM kill of it does: its API server lives on a moment and aborts what ran):
    the run goes on with server 1 to step 3. Then Ctrl-C (SIGINT to the run's process group, the
    watchdogs among it, which leave the servers to the trainer): the step finishes on server 1,
    last.ckpt is saved, outputs/actor exported, exit 130; the servers' end is not reported as a loss,
    and no server process is left. (SIGTERM to the group, and every server lost:
    tests/integration/test_rollout_servers_ranks.py.)"""
    process = cli(tiny_model_dir, tmp_path, "vllm_server_async")
    last = tmp_path / "checkpoints" / "last.ckpt"
    try:
        run = wait_for_step(process, last, 1)
        first, _ = server_parts(run)
        first["engine_core"].terminate()
        run = list({p.pid: p for p in run + wait_for_step(process, last, 3)}.values())
        os.killpg(process.pid, signal.SIGINT)
        output = output_or_stacks(process, timeout=120)
        assert process.returncode == 128 + signal.SIGINT, output[-3000:]
        assert "Traceback" not in output, output[-3000:]
        assert output.count("is lost") == 1 and "its requests go to the 1 server(s) left" in output, output[
            -3000:
        ]
        assert saved_step(last) >= 3
        assert (tmp_path / "actor" / "model.safetensors").is_file(), "HFExport did not run"
        assert all_end(run, timeout=30) == []
    finally:
        process.kill()
