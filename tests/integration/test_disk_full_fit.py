"""A disk that fills while ``last.ckpt`` is written: the previous ``last.ckpt`` stays intact and loadable,
the run ends with one line naming the directory and the bytes needed, and ``--ckpt_path last`` then
resumes from the intact file.

The disk is real: a tmpfs the test mounts (root only: CI runs as root), filled after the first save
as another process would fill it, so that the second save runs out of space midway (``ENOSPC`` inside
torch's zip writer).
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import lightning as L
import pytest
import torch
from helpers.cli_runs import fit_fails_with_one_line, rl_callbacks, small_fit_args

from lit_offpolicy.cli import main

FILLER = "filler"


def _mount(path: Path, size: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True
    )


@pytest.fixture
def small_disk(tmp_path) -> Path:
    """A 256 MiB tmpfs at ``tmp_path/disk``, unmounted afterwards."""
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("mounting a tmpfs needs root (CI runs as root)")
    disk = tmp_path / "disk"
    disk.mkdir()
    mounted = _mount(disk, "256m")
    if mounted.returncode != 0:
        pytest.skip(f"mount -t tmpfs failed here: {mounted.stderr.decode().strip()}")
    yield disk
    subprocess.run(["umount", "-l", str(disk)], check=True)


class FillDiskAfterFirstSave(L.Callback):
    """Before step 2, writes a file that leaves half of the saved ``last.ckpt``'s size free in its
    directory: the next save runs out of space partway through."""

    def __init__(self, dirpath: str) -> None:
        self.dirpath = Path(dirpath)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_step != 1:
            return
        saved = (self.dirpath / "last.ckpt").stat().st_size
        room = shutil.disk_usage(self.dirpath).free - saved // 2
        with (self.dirpath / FILLER).open("wb") as file:
            file.truncate(0)
            for start in range(0, room, 2**20):
                file.write(bytes(min(2**20, room - start)))


def _args(out: Path, disk: Path, steps: int, fill: bool) -> list[str]:
    callbacks = rl_callbacks(out)
    for callback in callbacks:
        if callback["class_path"].endswith("ModelCheckpoint"):  # last.ckpt only, every step
            callback["init_args"].update(dirpath=str(disk), every_n_train_steps=1, save_top_k=0)
        if callback["class_path"].endswith("Rollout"):
            callback["init_args"]["validation"] = {"every_n_steps": None, "stop_at": None}
    if fill:
        callbacks.append(
            {"class_path": f"{__name__}.FillDiskAfterFirstSave", "init_args": {"dirpath": str(disk)}}
        )
    return small_fit_args("grpo", _tiny(out), out, steps, callbacks)


def _tiny(out: Path) -> str:
    return str(out.parent / "model")


def test_a_disk_that_fills_during_a_checkpoint_keeps_the_previous_one_and_ends_with_one_line(
    small_disk, tiny_model_dir, tmp_path, capsys, monkeypatch
):
    monkeypatch.setattr("sys.argv", ["lit-offpolicy"])
    out = tmp_path / "out"
    out.mkdir()
    shutil.copytree(tiny_model_dir, _tiny(out))
    last = small_disk / "last.ckpt"

    line = fit_fails_with_one_line(_args(out, small_disk, 3, fill=True), capsys)
    saved = last.stat().st_size
    assert line.startswith(
        f"lit-offpolicy: error: checkpoint {last} was not written (No space left on device): "
    )
    needed = int(line.split("it needs about ", 1)[1].split(" bytes", 1)[0].replace(",", ""))
    assert saved * 0.9 <= needed <= saved * 1.1, (needed, saved)  # the estimate: the same state's size
    assert f"and {small_disk} has " in line and "the previous last.ckpt is intact" in line
    assert line.endswith("then resume with --ckpt_path last")
    assert sorted(p.name for p in small_disk.iterdir()) == [FILLER, "last.ckpt"]  # no temporary file left
    assert torch.load(last, weights_only=True)["global_step"] == 1

    (small_disk / FILLER).unlink()  # space freed: the run resumes from the intact step-1 checkpoint
    main([*_args(out, small_disk, 3, fill=False), "--ckpt_path", "last"])
    assert torch.load(last, weights_only=True)["global_step"] == 3
