"""HFExport at the end of a run a signal stopped: a re-run does not replace an earlier run's model."""

from __future__ import annotations

import os
import shutil
import signal

import lightning as L
import torch
from helpers.fits import make_data, make_trainer
from transformers import AutoModelForCausalLM

from lit_offpolicy.callbacks import HFExport
from lit_offpolicy.sft import SFTModule
from lit_offpolicy.training.checkpointing import PreemptionCheckpoint


class CtrlC(L.Callback):
    """Ctrl-C (SIGINT to this process) as step ``at_step`` starts."""

    def __init__(self, at_step: int) -> None:
        self.at_step = at_step

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step == self.at_step:
            os.kill(os.getpid(), signal.SIGINT)


def weights(directory) -> dict[str, torch.Tensor]:
    return AutoModelForCausalLM.from_pretrained(directory).state_dict()


def test_a_stopped_re_run_exports_beside_the_earlier_run_s_model(tiny_model_dir, tmp_path, capsys):
    """SFT stopped by Ctrl-C after 2 of 5 steps, checkpointing off (configs/sft_tiny.yaml), where the
    export directory holds an earlier run's model (the warm-up that the RL configs read): it stays, and
    the stopped run's model goes to ``<dirpath>.interrupted``, said in one line. (A first run exports
    to ``dirpath``: tests/integration/test_sft_cli.py.)"""
    export = tmp_path / "sft-tiny"
    shutil.copytree(tiny_model_dir, export)
    callbacks = [PreemptionCheckpoint(save=False), HFExport(str(export)), CtrlC(at_step=2)]
    trainer = make_trainer(callbacks, max_steps=5)
    module = SFTModule(tiny_model_dir, lr=1e-2)
    trainer.fit(module, datamodule=make_data(tiny_model_dir))
    assert trainer.global_step == 3, "the step in flight finished, then the run stopped"
    trained, written = module.actor.state_dict(), tmp_path / "sft-tiny.interrupted"
    assert all(torch.equal(trained[k], v) for k, v in weights(written).items()), "the stopped run's model"
    kept, earlier = weights(export), weights(tiny_model_dir)
    assert all(torch.equal(kept[k], v) for k, v in earlier.items()), "the earlier run's model stays"
    assert f"exported to {written}; {export} keeps an earlier run's model" in capsys.readouterr().out
