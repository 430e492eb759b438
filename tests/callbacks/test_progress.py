"""StepProgress counts RL steps, with a total, where an RL step makes several optimizer steps (issue #33)."""

from __future__ import annotations

import lightning as L
import pytest
from helpers.fits import make_data, make_rollout, make_trainer
from lightning.pytorch.callbacks import ModelCheckpoint

from lit_offpolicy import OffPolicyModule
from lit_offpolicy.callbacks import StepProgress
from lit_offpolicy.training.options import UpdateOptions


@pytest.mark.parametrize(("max_steps", "rl_steps"), [(3, 1), (5, 2)])
def test_the_bar_counts_rl_steps_out_of_the_rl_steps_max_steps_allows(tiny_model_dir, max_steps, rl_steps):
    """4 prompts x 4 samples in mini-batches of 4: 4 optimizer steps (trainer.max_steps' unit) per RL
    step; the bar used to show the optimizer steps, past its total (tqdm's ``4/?``)."""
    bar = StepProgress()
    trainer = make_trainer([make_rollout(), bar], max_steps=max_steps, enable_progress_bar=True)
    module = OffPolicyModule(model_path=tiny_model_dir, update=UpdateOptions(mini_batch_size=4))
    trainer.fit(module, datamodule=make_data(tiny_model_dir))
    shown = bar.train_progress_bar
    assert (module.policy_version, trainer.global_step) == (rl_steps, 4 * rl_steps)
    assert (shown.n, shown.total, shown.desc) == (rl_steps, rl_steps, "RL step: ")
    assert f"{rl_steps}/{rl_steps}" in str(shown)


def test_the_bar_has_a_total_without_max_steps(tiny_model_dir):
    """No ``max_steps``: the RL steps ``max_epochs`` allows (one per training batch)."""
    bar = StepProgress()
    trainer = make_trainer(
        [make_rollout(), bar], max_steps=-1, max_epochs=1, limit_train_batches=2, enable_progress_bar=True
    )
    trainer.fit(OffPolicyModule(model_path=tiny_model_dir), datamodule=make_data(tiny_model_dir))
    assert (bar.train_progress_bar.n, bar.train_progress_bar.total) == (2, 2)


class BarAtStart(L.Callback):
    """The bar's (n, initial, total) as the resumed run's first step starts."""

    def __init__(self, bar: StepProgress) -> None:
        self.bar, self.seen = bar, None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        shown = self.bar.train_progress_bar
        self.seen = self.seen or (shown.n, shown.initial, shown.total, str(shown))


def test_a_resumed_run_s_bar_starts_at_the_steps_done_out_of_the_run_s_total(tiny_model_dir, tmp_path):
    """Saved by a ModelCheckpoint after 2 RL steps (what a SIGKILLed run resumes from), resumed to 4: the
    bar starts at 2/4 and counts RL steps (it was Lightning's bare ``Training: 2/?``, and with a
    checkpoint saved at the end of a fit started at 0/4 with a negative rate; SFT's bar takes the same
    path with optimizer steps)."""
    data = make_data(tiny_model_dir)
    saves = ModelCheckpoint(dirpath=tmp_path, filename="saved", every_n_train_steps=2)  # mid-step, as a
    first = make_trainer([make_rollout(), saves], max_steps=3, enable_checkpointing=True)  # SIGKILLed run
    first.fit(OffPolicyModule(model_path=tiny_model_dir), datamodule=data)
    bar = StepProgress()
    probe = BarAtStart(bar)
    trainer = make_trainer([make_rollout(), bar, probe], max_steps=4, enable_progress_bar=True)
    trainer.fit(
        OffPolicyModule(model_path=tiny_model_dir), datamodule=data, ckpt_path=tmp_path / "saved.ckpt"
    )
    n, initial, total, shown = probe.seen
    assert (n, initial, total) == (2, 2, 4), shown
    assert "-" not in shown.split("[")[1], f"a negative time or rate: {shown}"
