"""Export the actor in HuggingFace format (safetensors + tokenizer), loadable by transformers and vLLM."""

from __future__ import annotations

import os
import re
import shutil
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import lightning as L
from transformers.utils import logging as hf_logging

from lit_offpolicy.core.checks import check_range
from lit_offpolicy.core.files import give_default_mode
from lit_offpolicy.models.lora import ADAPTER_DIR, has_adapters, merged_weights
from lit_offpolicy.rollout.weight_sync import gathered_state_dict
from lit_offpolicy.training.checkpointing import RUN_STAMP, step_label, stopping_signal


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


_UNNAMED = re.compile(r"(earlier-)?\d{8}-\d{6}(-\d+)?")
"""The places of runs without a name (their start time), and of models found at ``dirpath`` itself."""


class HFExport(L.Callback):
    """Save ``pl_module.actor`` and ``pl_module.tokenizer`` as a Hugging Face model directory at the end of
    training, each run into a place of its own, ``<dirpath>.runs/<start time>/`` (``20261129-051200``);
    ``dirpath`` is then a link to the latest finished run's model, so that the next run's config reads it.

    ``run_name``: a finished run's model then moves to ``<dirpath>.runs/<run_name>/``, a fixed place a
    config can depend on (configs/distill.yaml's teacher is the demo's, ``outputs/actor.runs/demo``),
    replacing the earlier run of that name. ``keep``: how many unnamed runs' models stay, the newest
    (0: all); older ones are removed once this run's is written, never a named one or the link's. A run
    stopped by a signal keeps its model in its own place and moves neither the link nor a named place.
    With ``every_n_steps`` > 0 also every that many RL steps (``pl_module.policy_version``), or training
    steps for modules without one.
    """

    def __init__(
        self, dirpath: str, every_n_steps: int = 0, run_name: str | None = None, keep: int = 5
    ) -> None:
        self.dirpath = dirpath
        self.every_n_steps = check_range("every_n_steps", every_n_steps, low=0)
        if run_name is not None and (
            not run_name
            or Path(run_name).name != run_name
            or run_name[0] == "."
            or _UNNAMED.fullmatch(run_name)
        ):
            raise ValueError(
                f"HFExport.run_name: {run_name!r} is not a directory name of its own (letters, digits, -_; "
                "not a start time)"
            )
        self.run_name = run_name
        self.keep = check_range("keep", keep, low=0)
        self.runs = Path(f"{dirpath}.runs")
        """Where each run's model goes."""
        self.place = self.runs / time.strftime(RUN_STAMP)
        """This run's place; a run that starts in the same second as another gets a suffix."""

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        stamp, suffix = self.place.name, 1
        while self.place.exists():  # another run started in the same second
            suffix += 1
            self.place = self.runs / f"{stamp}-{suffix}"

    @property
    def start_note(self) -> str:
        """Where the run's model goes, and what earlier runs' models stay: one line at start-up."""
        kept = (
            f"the {self.keep} newest unnamed runs' models stay (HFExport keep; 0: all)"
            if self.keep
            else "every run's model stays"
        )
        named = f", once finished to {self.runs / self.run_name}," if self.run_name else ""
        return f"HFExport writes to {self.place}{named} then links {self.dirpath} to it; {kept}"

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs, batch, batch_idx):
        step = getattr(pl_module, "policy_version", trainer.global_step)
        if self.every_n_steps and step % self.every_n_steps == 0:
            self.export(trainer, pl_module)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.export(trainer, pl_module)
        if not trainer.is_global_zero:
            return
        link, stopped = Path(self.dirpath), stopping_signal(trainer) is not None
        if stopped and link.exists():
            kept = f"{link} and {self.runs / self.run_name} keep" if self.run_name else f"{link} keeps"
            where = f"lit-offpolicy: stopped at {step_label(trainer)}: exported to {self.place}"
            print(f"{where}; {kept} an earlier run's model")
            return
        if self.run_name and not stopped:
            self.place = _replace(self.place, self.runs / self.run_name)
        self._link(link)
        self._remove_older()

    def export(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """Write the actor to this run's place (every rank gathers a sharded actor, rank 0 writes)."""
        state_dict = gathered_state_dict(trainer.strategy, pl_module.actor)  # export_hf merges LoRA
        if trainer.is_global_zero:
            export_hf(pl_module.actor, pl_module.tokenizer, self.place, state_dict)

    def _link(self, link: Path) -> None:
        """Point ``link`` at this run's place, in one rename; a model directory found there (an export
        of an earlier version, or one copied in) first moves, whole, to ``<dirpath>.runs/earlier-<time>``."""
        if link.exists() and not link.is_symlink():
            aside = self.runs / f"earlier-{time.strftime(RUN_STAMP, time.localtime(link.stat().st_mtime))}"
            link.rename(aside)
            print(f"lit-offpolicy: {link} was a model directory, not a link; it moved to {aside}")
        staging = link.with_name(f".{link.name}.link")
        staging.unlink(missing_ok=True)
        staging.symlink_to(os.path.relpath(self.place, link.parent), target_is_directory=True)
        os.replace(staging, link)

    def _remove_older(self) -> None:
        """Remove the unnamed runs' models past the ``keep`` newest, but the one the link names."""
        if not self.keep:
            return
        unnamed = sorted(
            (place for place in self.runs.iterdir() if _UNNAMED.fullmatch(place.name)),
            key=lambda place: place.name.removeprefix("earlier-"),
        )
        linked = Path(self.dirpath).resolve()
        older = [
            place for place in unnamed[: -self.keep] if place.resolve() not in (linked, self.place.resolve())
        ]
        for place in older:
            shutil.rmtree(place, ignore_errors=True)
        if older:
            print(
                f"lit-offpolicy: removed {len(older)} older run(s)' models from {self.runs} "
                f"({', '.join(place.name for place in older)}): the {self.keep} newest unnamed stay "
                "(HFExport keep; keep: 0 keeps all, run_name keeps a run's for good)"
            )


def _replace(source: Path, target: Path) -> Path:
    """Move ``source`` to ``target`` in renames, replacing an earlier ``target`` whole; ``target``."""
    retired = target.with_name(f".{target.name}.retired")
    shutil.rmtree(retired, ignore_errors=True)
    if target.exists():
        target.rename(retired)
    source.rename(target)
    shutil.rmtree(retired, ignore_errors=True)
    return target
