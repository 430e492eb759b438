"""The SFT warm-up as the README runs it, ``lit-offpolicy fit --config configs/sft_tiny.yaml``: the console
script in a fresh directory, the tiny Llama at ``outputs/tiny-init``, ``OMP_NUM_THREADS`` unset as in a
user's shell, and Ctrl-C sent to the process group as a terminal sends it. A second config only
adds a callback that records each step (and sleeps, so that the signal lands mid-run); the other run
turns checkpointing on, as the RL configs have it."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import lightning as L
import pytest
import torch
import yaml
from helpers import CONFIGS, subprocess_env
from transformers import AutoModelForCausalLM

LIT_OFFPOLICY = Path(sys.executable).with_name("lit-offpolicy")
"""The console script a user runs."""
MAX_STEPS = 40
SIGNAL_AFTER_STEP = 2


class StepLog(L.Callback):
    """Writes torch's thread count at the start, appends each finished step to ``path`` (one JSON
    line each) and sleeps ``seconds`` after it."""

    def __init__(self, path: str, seconds: float) -> None:
        self.path, self.seconds = Path(path), seconds

    def on_train_start(self, trainer, pl_module):
        self.path.with_suffix(".threads").write_text(str(torch.get_num_threads()))

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        with self.path.open("a") as file:
            file.write(json.dumps({"step": trainer.global_step}) + "\n")
        time.sleep(self.seconds)


def steps(path: Path) -> list[int]:
    return [json.loads(line)["step"] for line in path.read_text().splitlines()] if path.is_file() else []


def interrupted_sft(directory: Path, model_dir: str, checkpointing: bool) -> SimpleNamespace:
    """``lit-offpolicy fit --config configs/sft_tiny.yaml --config test.yaml`` in ``directory``, Ctrl-C
    to its process group after step ``SIGNAL_AFTER_STEP``; its exit status and output."""
    shutil.copytree(model_dir, directory / "outputs" / "tiny-init")
    log = directory / "steps.jsonl"
    callbacks = [{"class_path": f"{__name__}.StepLog", "init_args": {"path": str(log), "seconds": 0.5}}]
    trainer = {"max_steps": MAX_STEPS, "callbacks+": callbacks}
    if checkpointing:
        trainer["enable_checkpointing"] = True
        callbacks.append(
            {
                "class_path": "lightning.pytorch.callbacks.ModelCheckpoint",
                "init_args": {"dirpath": "outputs/checkpoints", "save_last": True},
            }
        )
    (directory / "test.yaml").write_text(yaml.safe_dump({"trainer": trainer}))
    env = subprocess_env()
    del env["OMP_NUM_THREADS"]  # as in a user's shell: torch's default is one thread per core
    command = [str(LIT_OFFPOLICY), "fit", "--config", str(CONFIGS / "sft_tiny.yaml"), "--config", "test.yaml"]
    process = subprocess.Popen(
        command, cwd=directory, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        while len(steps(log)) < SIGNAL_AFTER_STEP:
            assert process.poll() is None, process.communicate()[0][-3000:]
            assert time.monotonic() < deadline, f"no step {SIGNAL_AFTER_STEP} within 120 s"
            time.sleep(0.1)
        os.killpg(process.pid, signal.SIGINT)
        output, _ = process.communicate(timeout=60)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
    threads = int(log.with_suffix(".threads").read_text())
    return SimpleNamespace(
        directory=directory, returncode=process.returncode, output=output, steps=steps(log), threads=threads
    )


@pytest.fixture(scope="module")
def runs(tiny_model_dir, tmp_path_factory) -> dict[str, SimpleNamespace]:
    return {
        name: interrupted_sft(tmp_path_factory.mktemp(name), tiny_model_dir, checkpointing)
        for name, checkpointing in (("as_written", False), ("checkpointing", True))
    }


@pytest.mark.slow
def test_the_tiny_models_warm_up_runs_on_one_thread_and_says_so(runs):
    """Two threads of a 1M-parameter model wait on each other while another process is busy: 30x slower."""
    run = runs["as_written"]
    assert run.threads == 1
    if (os.cpu_count() or 1) > 1:
        assert "torch runs on 1 CPU thread(s)" in run.output, run.output[-3000:]


@pytest.mark.slow
@pytest.mark.parametrize("name", ["as_written", "checkpointing"])
def test_ctrl_c_finishes_the_step_saves_exports_and_exits_130(runs, name):
    """As the RL run: the step in flight finishes, ``last.ckpt`` is saved where checkpointing is on,
    HFExport exports that step (``on_train_end`` runs) and the command exits 130 (was: exit 1, nothing
    saved, a KeyboardInterrupt traceback, with sft_tiny.yaml's checkpointing off)."""
    run = runs[name]
    assert run.returncode == 128 + signal.SIGINT, run.output[-3000:]
    assert "Traceback" not in run.output, run.output[-3000:]
    assert SIGNAL_AFTER_STEP <= len(run.steps) < MAX_STEPS, "stopped after the step in flight"
    outputs = run.directory / "outputs"
    exported = AutoModelForCausalLM.from_pretrained(outputs / "sft-tiny").state_dict()
    initial = AutoModelForCausalLM.from_pretrained(outputs / "tiny-init").state_dict()
    assert any(not torch.equal(exported[key], initial[key]) for key in initial), (
        "the export is the trained actor"
    )
    last = outputs / "checkpoints" / "last.ckpt"
    if name == "as_written":
        assert "checkpointing is off, nothing saved" in run.output
        assert not (outputs / "checkpoints").exists()
        return
    saved = torch.load(last, map_location="cpu", weights_only=True)
    assert saved["global_step"] == run.steps[-1], "the last finished step is in last.ckpt"
    for key, tensor in exported.items():
        assert torch.equal(saved["state_dict"][f"actor.{key}"], tensor), (
            f"export is not the saved step: {key}"
        )
