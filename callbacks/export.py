"""Export the actor in HuggingFace format (safetensors + tokenizer), loadable by transformers and vLLM."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import lightning as L
from transformers.utils import logging as hf_logging

from lit_offpolicy.core.checks import check_range
from lit_offpolicy.core.files import give_default_mode
from lit_offpolicy.models.lora import ADAPTER_DIR, has_adapters, merged_weights
from lit_offpolicy.rollout.weight_sync import gathered_state_dict
from lit_offpolicy.training.checkpointing import step_label, stopping_signal


def export_hf(model, tokenizer, dirpath: str | Path, state_dict: dict | None = None) -> Path:
    """Write ``model`` and ``tokenizer`` to ``dirpath`` atomically: a reader never sees a half-written export.

    Files go to a sibling temporary directory first, which then replaces ``dirpath`` by renames.
    ``state_dict`` (default: the model's own) supplies the weights, e.g. gathered from shards. A LoRA
    model (``lora.add_lora``) is written as the plain base model with its adapters merged, loadable
    without peft, and its adapters alone, in peft's format, in the subfolder ``adapter``.
    """
    target = Path(dirpath)
    staging = target.with_name(f".{target.name}.staging")
    retired = target.with_name(f".{target.name}.retired")
    for leftover in (staging, retired):
        shutil.rmtree(leftover, ignore_errors=True)
    with _no_progress_bar():
        _save(model, tokenizer, staging, state_dict)
    give_default_mode(staging)  # safetensors writes the weights 0600
    if target.exists():
        target.rename(retired)
    staging.rename(target)
    shutil.rmtree(retired, ignore_errors=True)
    return target


def _save(model, tokenizer, staging: Path, state_dict: dict | None) -> None:
    if has_adapters(model):
        state_dict = model.state_dict() if state_dict is None else state_dict
        merged = merged_weights(model, state_dict)
        model.get_base_model().save_pretrained(staging, state_dict=merged, safe_serialization=True)
        model.save_pretrained(staging / ADAPTER_DIR, state_dict=state_dict)  # peft keeps the adapters'
    else:
        model.save_pretrained(staging, state_dict=state_dict, safe_serialization=True)
    tokenizer.save_pretrained(staging)


@contextmanager
def _no_progress_bar() -> Iterator[None]:
    """Without transformers' "Writing model shards" bar: an export is one event, not a second progress bar
    below the run's."""
    enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if enabled:
            hf_logging.enable_progress_bar()


class HFExport(L.Callback):
    """Save ``pl_module.actor`` and ``pl_module.tokenizer`` to ``dirpath`` at the end of training.

    With ``every_n_steps`` > 0 also every that many RL steps (``pl_module.policy_version``), or
    training steps for modules without one.
    """

    def __init__(self, dirpath: str, every_n_steps: int = 0) -> None:
        self.dirpath = dirpath
        self.every_n_steps = check_range("every_n_steps", every_n_steps, low=0)
        self._exported = False  # this run has written dirpath

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs, batch, batch_idx):
        step = getattr(pl_module, "policy_version", trainer.global_step)
        if self.every_n_steps and step % self.every_n_steps == 0:
            self.export(trainer, pl_module)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.export(trainer, pl_module, self._final_dirpath(trainer))

    def export(self, trainer: L.Trainer, pl_module: L.LightningModule, dirpath: str | None = None) -> None:
        # every rank takes part in the gather of a sharded actor (FSDP, ZeRO-3); rank 0 writes
        state_dict = gathered_state_dict(trainer.strategy, pl_module.actor)  # export_hf merges LoRA
        if trainer.is_global_zero:
            export_hf(pl_module.actor, pl_module.tokenizer, dirpath or self.dirpath, state_dict)
        self._exported = self._exported or dirpath in (None, self.dirpath)

    def _final_dirpath(self, trainer: L.Trainer) -> str:
        """``dirpath``; for a run stopped by a signal (Ctrl-C, SIGUSR1) where ``dirpath`` holds an earlier
        run's export, ``<dirpath>.interrupted``: a stopped re-run does not replace a finished model
        (the SFT warm-up's, which the RL configs read) with a half-trained one."""
        earlier_model = (Path(self.dirpath) / "config.json").is_file()
        if stopping_signal(trainer) is None or self._exported or not earlier_model:
            return self.dirpath
        interrupted = f"{self.dirpath}.interrupted"
        if trainer.is_global_zero:
            print(
                f"lit-offpolicy: stopped at {step_label(trainer)}: exported to {interrupted}; "
                f"{self.dirpath} keeps an earlier run's model"
            )
        return interrupted
