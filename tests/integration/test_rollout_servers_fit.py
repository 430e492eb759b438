"""The rollout-server configs through the CLI: what they print, the documented ``urls`` command, a
server that does not answer; and the helpers of the runs on launched servers. The runs themselves,
through the CLI with real ``vllm serve`` processes, are tests/integration/test_rollout_servers_ranks.py's:
2 trainer ranks take every path that 1 takes (sync and async, a server's process killed, every server
lost, SIGTERM to the group, a resume), and their agreement besides. (A SIGKILLed trainer: its watchdogs
end the servers by the same path as a SIGTERM, tests/rollout/test_server_parts.py.)"""

from __future__ import annotations

import json
import signal
import subprocess
import time
from pathlib import Path

import psutil
import pytest
import yaml
from helpers import CONFIGS, REPO
from helpers.cli_runs import HASH_REWARD, fit_fails_with_one_line, redirect, small_fit_args

from lit_offpolicy.cli import main
from lit_offpolicy.rollout import VLLMServerSpec
from lit_offpolicy.rollout.server import supervise
from lit_offpolicy.rollout.server.process import engine_core_of, server_of

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
    engine = "{class_path: lit_offpolicy.rollout.VLLMServerSpec, init_args: {urls: [http://127.0.0.1:8000]}}"
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
    assert init_args["urls"] == ["http://127.0.0.1:8000"] and init_args["launch"] is None
    VLLMServerSpec(**init_args)  # what the run builds: not refused


def server_parts(run: list[psutil.Process]) -> list[dict[str, psutil.Process]]:
    """Each launched server's processes, from the run's: its watchdog, API server and engine core."""
    servers = []
    for watchdog in run:
        if watchdog.cmdline()[1:2] != [supervise.__file__] or supervise.GUARD in watchdog.cmdline():
            continue  # not a watchdog, or a watchdog's guard
        api_server = server_of(watchdog)
        servers.append(
            {"watchdog": watchdog, "api_server": api_server, "engine_core": engine_core_of(api_server)}
        )
    assert len(servers) == 2, [p.cmdline()[:4] for p in run]
    return servers
