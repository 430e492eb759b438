"""A real ``lit-offpolicy fit`` process killed with SIGKILL mid-run resumes from its last checkpoint
(``--ckpt_path last``) and ends where, and as, the uninterrupted run ends.

Real parts: the CLI in a subprocess, the tiny Llama, the HF engine, ``ModelCheckpoint`` every step
with ``save_last`` (written by the CLI's atomic checkpoint writer), SIGKILL from the operating
system. The reward is ``HashReward`` (tests/helpers/__init__.py) so that the weights move; rollouts are
unseeded so that equal samples after the resume need the restored RNG.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import lightning as L
import pytest
import torch
import yaml
from helpers import subprocess_env
from helpers.cli_runs import small_fit_args
from transformers import AutoModelForCausalLM

from lit_offpolicy.cli import main
from lit_offpolicy.core.tensorboard import latest_run, read_scalars

MAX_STEPS = 6
KILL_AFTER_STEP = 2


class StepLog(L.Callback):
    """Appends one JSON line per finished step (step, version, prompts) to ``path``; sleeps ``seconds``
    at each step start so that the test can kill the process mid-run; saves the actor at the end."""

    def __init__(self, path: str, seconds: float = 0.0) -> None:
        self.path, self.seconds = path, seconds

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        time.sleep(self.seconds)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        row = {"step": trainer.global_step, "version": pl_module.policy_version, "prompts": batch["prompt"]}
        with open(self.path, "a") as file:
            file.write(json.dumps(row) + "\n")

    def on_train_end(self, trainer, pl_module):
        state = {"global_step": trainer.global_step, "actor": pl_module.actor.state_dict()}
        torch.save(state, self.path + ".end.pt")


def write_config(
    model_dir: str,
    out: Path,
    seconds: float,
    reward_timeout: float | None = None,
    export: bool = False,
    tensorboard: bool = False,
) -> Path:
    """A fit of ``MAX_STEPS`` steps writing under ``out``; ``export``: with ``HFExport`` to ``out/actor``;
    ``tensorboard``: its metrics to TensorBoard under ``out/logs`` (else no logger)."""
    rollout = {
        "sampling": {"n": 4, "max_tokens": 5, "seed": None},
        "reward": {"fn": {"class_path": "helpers.HashReward"}, "timeout": reward_timeout},
        "validation": {"every_n_steps": 0},
        "log_samples_every_n_steps": 0,
    }
    config = {
        "seed_everything": 0,
        "trainer": {
            "accelerator": "cpu",
            "devices": 1,
            "max_steps": MAX_STEPS,
            "logger": {
                "class_path": "lightning.pytorch.loggers.TensorBoardLogger",
                "init_args": {"save_dir": str(out / "logs")},
            }
            if tensorboard
            else False,
            "log_every_n_steps": 1,
            "enable_progress_bar": False,
            "enable_model_summary": False,
            "limit_val_batches": 0,
            "num_sanity_val_steps": 0,
            "default_root_dir": str(out),
            "callbacks": [
                {"class_path": "lit_offpolicy.callbacks.Rollout", "init_args": rollout},
                {
                    "class_path": f"{__name__}.StepLog",
                    "init_args": {"path": str(out / "steps.jsonl"), "seconds": seconds},
                },
                {
                    "class_path": "lightning.pytorch.callbacks.ModelCheckpoint",
                    "init_args": {"dirpath": str(out / "ckpt"), "save_last": True, "every_n_train_steps": 1},
                },
            ]
            + (
                [
                    {
                        "class_path": "lit_offpolicy.callbacks.HFExport",
                        "init_args": {"dirpath": str(out / "actor")},
                    }
                ]
                if export
                else []
            ),
        },
        "model": {
            "class_path": "lit_offpolicy.OffPolicyModule",
            "init_args": {"model_path": model_dir, "optim": {"lr": 1.0e-3}},
        },
        "data": {"batch_size": 4, "num_val_samples": 8},
    }
    path = out / "config.yaml"
    out.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(config))
    return path


def cli(*args: str, own_group: bool = False) -> subprocess.Popen:
    """``lit-offpolicy ARGS`` in a subprocess; ``own_group``: as the leader of a new process group."""
    env = subprocess_env()
    return subprocess.Popen(
        [sys.executable, "-m", "lit_offpolicy", *args],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=own_group,
    )


def group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def saved_step(path: Path) -> int:
    """The global step of a checkpoint file, -1 when there is none yet."""
    if not path.is_file():
        return -1
    return torch.load(path, map_location="cpu", weights_only=True)["global_step"]


def read_steps(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "steps.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_sigkilled_run_resumes_from_last_checkpoint_to_the_same_end(tiny_model_dir, tmp_path, monkeypatch):
    killed_dir = tmp_path / "killed"
    config = write_config(tiny_model_dir, killed_dir, seconds=0.5)
    process = cli("fit", "--config", str(config))
    last = killed_dir / "ckpt" / "last.ckpt"
    deadline = time.monotonic() + 120
    while saved_step(last) < KILL_AFTER_STEP:
        assert process.poll() is None, process.communicate()[0][-3000:]
        assert time.monotonic() < deadline, "no checkpoint after step 2 within 120 s"
        time.sleep(0.1)
    process.send_signal(signal.SIGKILL)
    process.communicate()
    assert process.returncode == -signal.SIGKILL
    before_kill = read_steps(killed_dir)
    assert KILL_AFTER_STEP <= len(before_kill) < MAX_STEPS, "killed mid-run"
    resume_from = saved_step(last)  # a complete checkpoint, whatever the kill interrupted

    resumed = cli("fit", "--config", str(config), "--ckpt_path", "last")
    output, _ = resumed.communicate(timeout=300)
    assert resumed.returncode == 0, output[-3000:]
    assert "dataloader is not resumable" not in output, "Lightning's warning, wrong for our sampler"
    after_resume = read_steps(killed_dir)[len(before_kill) :]
    assert [row["step"] for row in after_resume] == list(range(resume_from + 1, MAX_STEPS + 1))
    assert [row["version"] for row in after_resume] == list(range(resume_from + 1, MAX_STEPS + 1))
    end = torch.load(str(killed_dir / "steps.jsonl") + ".end.pt", weights_only=True)
    assert end["global_step"] == MAX_STEPS

    # the same configuration, uninterrupted, in this process
    whole_dir = tmp_path / "whole"
    monkeypatch.setattr(sys, "argv", ["lit-offpolicy"])
    main(["fit", "--config", str(write_config(tiny_model_dir, whole_dir, seconds=0.0))])
    whole = read_steps(whole_dir)
    assert [row["prompts"] for row in after_resume] == [row["prompts"] for row in whole[resume_from:]]
    whole_end = torch.load(str(whole_dir / "steps.jsonl") + ".end.pt", weights_only=True)
    # the same float32 operations on the same inputs, so equal to the bit: the killed run's process has
    # one OpenMP thread and this one the default, but the tiny model's elementwise ops and reductions
    # run on one thread either way (below ATen's grain size) and BLAS splits a product's outputs, not
    # its sums, among threads. 1e-6 (≈ 10 ulps of weights ≤ 1) absorbs last bits only, far below a step.
    for name, tensor in whole_end["actor"].items():
        assert torch.allclose(end["actor"][name], tensor, atol=1e-6, rtol=0), name


@pytest.mark.slow
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=lambda s: s.name)
def test_a_signal_to_the_process_group_saves_and_exits_in_seconds(signum, tiny_model_dir, tmp_path):
    """A signal to the whole process group, as ``timeout`` or ``kill -- -PGID`` (SIGTERM), a terminal's
    Ctrl-C (SIGINT) and SLURM's ``--signal`` (SIGTERM, SIGUSR1) send it, with the reward in worker
    processes (the default ``reward.timeout``): the workers ignore it and score the step in flight,
    the trainer saves ``last.ckpt`` and exits with 128 + the signal within seconds, and no process of
    the group is left (SIGTERM used to wait out the reward timeout, then hang for good; Ctrl-C lost
    the steps since the last periodic checkpoint). Lightning alone would end a SIGTERMed run with 0, as
    if it had completed: after SIGTERM the run resumes from the file by its path to the end, as
    configs/slurm/rl.sbatch does (LightningCLI's re-parse of the checkpoint's hyperparameters used to
    end every such command before it started). SIGUSR1 takes the same path: tests/integration/test_slurm.py
    sends it to real tasks."""
    out = tmp_path / signum.name
    config = write_config(tiny_model_dir, out, 0.5, reward_timeout=60.0, export=True, tensorboard=True)
    process = cli("fit", "--config", str(config), own_group=True)
    last = out / "ckpt" / "last.ckpt"
    deadline = time.monotonic() + 120
    try:
        while saved_step(last) < 1:
            assert process.poll() is None, process.communicate()[0][-3000:]
            assert time.monotonic() < deadline, "no checkpoint after step 1 within 120 s"
            time.sleep(0.1)
        signalled = time.monotonic()
        os.killpg(process.pid, signum)
        output, _ = process.communicate(timeout=30)
        assert time.monotonic() - signalled < 30
        assert process.returncode == 128 + signum, output[-3000:]
        assert "signal received: saved" in output
        assert "not scored" not in output and "worker died" not in output, "a worker died of the signal"
        steps = read_steps(out)
        assert len(steps) < MAX_STEPS, "stopped early"
        assert saved_step(last) == steps[-1]["step"], "the last finished step is in last.ckpt"
        run = latest_run(out / "logs" / "lightning_logs")
        logged = [step for step, _ in read_scalars(run, "reward/mean")]
        assert logged == list(range(len(steps))), "every finished step's metrics are written out"
        assert not list(last.parent.glob("last-v*.ckpt")), "one last checkpoint, no duplicate"
        if signum != signal.SIGTERM:  # these stop the run cleanly: its end-of-training callbacks run
            exported = AutoModelForCausalLM.from_pretrained(out / "actor")
            trained = torch.load(last, map_location="cpu", weights_only=True)["state_dict"]
            for name, tensor in exported.state_dict().items():
                assert torch.equal(trained[f"actor.{name}"], tensor), f"export is not the saved step: {name}"
        gone = time.monotonic() + 10
        while group_alive(process.pid) and time.monotonic() < gone:
            time.sleep(0.1)
        assert not group_alive(process.pid), "a process of the group outlived the run"
        if signum == signal.SIGTERM:
            resumed = cli("fit", "--config", str(out / "config.yaml"), "--ckpt_path", str(last))
            output, _ = resumed.communicate(timeout=300)
            assert resumed.returncode == 0, output[-3000:]
            after = read_steps(out)[len(steps) :]
            assert [row["step"] for row in after] == list(range(steps[-1]["step"] + 1, MAX_STEPS + 1))
    finally:
        if group_alive(process.pid):
            os.killpg(process.pid, signal.SIGKILL)


class CtrlCTwice(L.Callback):
    """Ctrl-C, then Ctrl-C again, at the start of step ``at_step`` (a user who does not want to wait
    for the step): each SIGINT to this process, handled before the next is sent."""

    def __init__(self, at_step: int) -> None:
        self.at_step = at_step

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step == self.at_step:
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.1)  # the first handler runs (Python coalesces a signal still pending)
            os.kill(os.getpid(), signal.SIGINT)


def test_a_second_ctrl_c_stops_at_once_with_exit_130_and_one_line(tiny_model_dir, tmp_path, capsys):
    """The second Ctrl-C interrupts the step at once; the run exits 130, as the first Ctrl-C's stop
    does, with one line saying that nothing of the step was saved, not Lightning's status 1 after
    "Detected KeyboardInterrupt". In this process: the handlers are the CLI's own."""
    reward = {"fn": {"class_path": "helpers.HashReward"}, "timeout": None}
    callbacks = [
        {"class_path": "lit_offpolicy.callbacks.Rollout", "init_args": {"reward": reward}},
        {"class_path": f"{__name__}.CtrlCTwice", "init_args": {"at_step": 1}},
    ]
    with pytest.raises(SystemExit) as exit_info:
        main(small_fit_args("grpo", tiny_model_dir, tmp_path, 3, callbacks))
    assert exit_info.value.code == 128 + signal.SIGINT
    err = capsys.readouterr().err
    assert "lit-offpolicy: a second Ctrl-C stopped the run at once: nothing of the current step" in err, err
    assert "Traceback" not in err, err
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler, "the handlers stay the CLI's"
