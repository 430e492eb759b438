"""HFExport: each run's model in a place of its own, ``dirpath`` a link to the latest finished one; a
stopped run leaves the link; a fixed ``run_name`` for a model a config depends on; ``keep`` bounds the
unnamed runs' models."""

from __future__ import annotations

import os
import shutil
import signal

import lightning as L
import pytest
import torch
from helpers.fits import make_data, make_trainer
from transformers import AutoModelForCausalLM

from lit_offpolicy.callbacks import HFExport
from lit_offpolicy.sft import SFTModule
from lit_offpolicy.training.checkpointing import PreemptionCheckpoint

pytestmark = pytest.mark.slow  # tiny fits: not part of test-numerics


class CtrlC(L.Callback):
    """Ctrl-C (SIGINT to this process) as step ``at_step`` starts."""

    def __init__(self, at_step: int) -> None:
        self.at_step = at_step

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step == self.at_step:
            os.kill(os.getpid(), signal.SIGINT)


def weights(directory) -> dict[str, torch.Tensor]:
    return AutoModelForCausalLM.from_pretrained(directory).state_dict()


def same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def sft(model_dir: str, export: HFExport, *callbacks: L.Callback, steps: int = 1) -> SFTModule:
    module = SFTModule(model_dir, lr=1e-2)
    make_trainer([*callbacks, export], max_steps=steps).fit(module, datamodule=make_data(model_dir))
    return module


def test_each_run_has_its_place_and_the_link_names_the_latest(tiny_model_dir, tmp_path, capsys):
    export = tmp_path / "actor"
    first = HFExport(str(export), run_name="first")
    trained = sft(tiny_model_dir, first).actor.state_dict()
    second = HFExport(str(export))
    sft(tiny_model_dir, second, steps=2)
    assert export.is_symlink() and export.resolve() == second.place.resolve()
    assert same(weights(export), weights(second.place)) and not same(weights(export), trained)
    assert same(weights(tmp_path / "actor.runs" / "first"), trained), "the first run's model stays"
    assert os.readlink(export) == f"actor.runs/{second.place.name}"  # relative: the folder can move
    assert second.start_note == (
        f"HFExport writes to {second.place} then links {export} to it; the 5 newest unnamed runs' "
        "models stay (HFExport keep; 0: all)"
    )
    assert first.place == tmp_path / "actor.runs" / "first" and not list(export.parent.glob("actor.runs/.*"))


@pytest.mark.parametrize("run_name", [None, "demo"])
def test_a_stopped_re_run_exports_to_its_place_and_leaves_the_link(
    tiny_model_dir, tmp_path, capsys, run_name
):
    """SFT stopped by Ctrl-C after 2 of 5 steps, checkpointing off (configs/sft_tiny.yaml), where the link
    names an earlier run's model (the warm-up that the RL configs read; with ``run_name``, the demo's
    model that configs/distill.yaml reads): the link and the named place stay, the stopped run's model
    is in its own place, said in one line. (A first run links its model: test_sft_cli.py.)"""
    export = tmp_path / "sft-tiny"
    earlier = sft(tiny_model_dir, HFExport(str(export), run_name=run_name)).actor.state_dict()
    capsys.readouterr()
    stopped = HFExport(str(export), run_name=run_name)
    trainer = make_trainer([PreemptionCheckpoint(save=False), stopped, CtrlC(at_step=2)], max_steps=5)
    module = SFTModule(tiny_model_dir, lr=1e-2)
    trainer.fit(module, datamodule=make_data(tiny_model_dir))
    assert trainer.global_step == 3, "the step in flight finished, then the run stopped"
    assert same(weights(stopped.place), module.actor.state_dict()), "the stopped run's model"
    assert same(weights(export), earlier), "the link still names the earlier run's model"
    kept = f"{export} and {tmp_path / 'sft-tiny.runs' / run_name} keep" if run_name else f"{export} keeps"
    assert f"exported to {stopped.place}; {kept} an earlier run's model" in capsys.readouterr().out
    if run_name:
        assert same(weights(tmp_path / "sft-tiny.runs" / run_name), earlier), "the named place stays"


def test_a_model_directory_at_dirpath_moves_whole_into_the_runs_and_keep_bounds_the_unnamed(
    tiny_model_dir, tmp_path, capsys
):
    """An export of an earlier version (a directory, not a link) moves into ``<dirpath>.runs/earlier-*``;
    with ``keep`` 2, a third unnamed run removes the oldest unnamed model, never a named one."""
    export = tmp_path / "actor"
    shutil.copytree(tiny_model_dir, export)
    os.utime(export, (0, 0))  # older than any run
    named = HFExport(str(export), run_name="demo", keep=2)
    sft(tiny_model_dir, named)
    out = capsys.readouterr().out
    (aside,) = (tmp_path / "actor.runs").glob("earlier-*")
    assert f"{export} was a model directory, not a link; it moved to {aside}" in out
    assert same(weights(aside), weights(tiny_model_dir))
    places = []
    for _ in range(2):
        run = HFExport(str(export), keep=2)
        sft(tiny_model_dir, run)
        places.append(run.place)
    out = capsys.readouterr().out
    assert not aside.exists() and all(place.is_dir() for place in places) and named.place.is_dir()
    assert (
        f"removed 1 older run(s)' models from {tmp_path / 'actor.runs'} ({aside.name}): the 2 newest" in out
    )
    assert export.resolve() == places[-1].resolve()


@pytest.mark.parametrize("name", ["", "a/b", "..", ".hidden", "20261129-051200"])
def test_a_run_name_that_is_no_directory_name_is_refused(tmp_path, name):
    with pytest.raises(ValueError, match="HFExport.run_name: .* is not a directory name of its own"):
        HFExport(str(tmp_path / "actor"), run_name=name)
