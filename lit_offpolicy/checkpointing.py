"""Checkpoints that survive faults: atomic writes, safe loads, and a save before a preempted run exits.

- :class:`AtomicCheckpointIO` writes each checkpoint to a temporary file in the target's directory,
  flushes it to disk (``fsync``) and renames it over the target (``os.replace``, atomic on POSIX), so
  a process killed mid-write leaves the previous checkpoint intact and never a truncated
  ``last.ckpt``. It loads with ``weights_only=True`` unless told otherwise.
- :class:`PreemptionCheckpoint` saves ``last.ckpt`` at the end of the step during which SIGTERM or
  SIGUSR1 arrived, then lets the run stop; ``fit --ckpt_path last`` resumes from it.

:func:`install_fault_tolerance` puts both on a Trainer; the ``lit-offpolicy`` CLI does it for every run.
:func:`rng_state` / :func:`set_rng_state` carry the RNGs through a checkpoint (``OffPolicyModule``).
"""

from __future__ import annotations

import logging
import os
import random
import signal
import tempfile
import threading
from pathlib import Path
from typing import Any

import lightning as L
import numpy as np
import torch
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.utilities import rank_zero_info

from lit_offpolicy.files import give_default_mode

log = logging.getLogger(__name__)

TEMP_SUFFIX = ".tmp"


def _keep_on_cpu(storage, location):
    return storage  # TorchCheckpointIO's default: tensors load where torch.load puts CPU storages


class AtomicCheckpointIO(TorchCheckpointIO):
    """``torch.save`` to ``.NAME.XXXX.tmp`` next to the target, ``fsync``, then ``os.replace`` onto it.

    Lightning's own writer stages the file through fsspec, whose local transaction writes into the
    system temporary directory and moves the file across file systems (a copy, not atomic) and never
    calls ``fsync``. A temporary name ends in ``.tmp``, so ``ckpt_path="last"`` (which looks for
    ``last*.ckpt``) can never pick a half-written file. Remote URLs (``s3://``...) keep the fsspec path.
    """

    def save_checkpoint(self, checkpoint: dict[str, Any], path, storage_options: Any | None = None) -> None:
        if storage_options is not None or "://" in str(path):
            super().save_checkpoint(checkpoint, path, storage_options)
            return
        atomic_torch_save(checkpoint, Path(path))

    def load_checkpoint(self, path, map_location=_keep_on_cpu, weights_only: bool | None = None) -> dict:
        """Load with ``weights_only=True`` (tensors and plain containers only) unless asked otherwise."""
        safe = True if weights_only is None else weights_only
        return super().load_checkpoint(path, map_location=map_location, weights_only=safe)


def atomic_torch_save(obj: Any, path: Path) -> None:
    """``torch.save(obj, path)`` such that ``path`` holds either its old content or all of the new one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    descriptor, temp_name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=TEMP_SUFFIX)
    try:
        with os.fdopen(descriptor, "wb") as file:
            torch.save(obj, file)
            file.flush()
            os.fsync(file.fileno())
        give_default_mode(temp_name)  # mkstemp made it 0600
        os.replace(temp_name, path)
    except BaseException:
        Path(temp_name).unlink(missing_ok=True)
        raise
    _fsync_directory(path.parent)  # make the rename itself durable


def _fsync_directory(directory: Path) -> None:
    descriptor = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


class PreemptionCheckpoint(L.Callback):
    """On SIGTERM, SIGUSR1 or Ctrl-C (SIGINT), save ``last.ckpt`` at the end of the current step, then stop.

    SIGTERM: Lightning's signal connector already records it (``trainer.received_sigterm``) and
    stops the run after the step with ``SIGTERMException``; this callback saves the checkpoint first.
    SIGUSR1: handled here only when nothing else handles it. Under SLURM with auto-requeue
    (Lightning's default there), Lightning owns SIGUSR1: it saves ``hpc_ckpt_*.ckpt`` into
    ``default_root_dir``, requeues the job and resumes from it; this callback leaves that alone.
    Ctrl-C: the first one asks for the same stop (the run then ends normally: ``on_train_end``
    callbacks such as ``HFExport`` still run, and the CLI exits with 130); a second one interrupts at
    once, as Python's default handler does.

    The checkpoint is saved in ``on_train_batch_end``, the same point at which ``ModelCheckpoint``
    saves, so it resumes like any other: same global step, optimizer, RNG and data position. The
    decision is reduced over ranks, so all processes save (a collective under FSDP/DeepSpeed) or none.

    Args:
        dirpath: directory of the checkpoint; None: the first ``ModelCheckpoint``'s directory, else
            ``<default_root_dir>/checkpoints``.
        filename: file name without ``.ckpt``; "last" makes ``fit --ckpt_path last`` find it.
    """

    def __init__(self, dirpath: str | None = None, filename: str = "last") -> None:
        if not filename:
            raise ValueError("filename='' is not supported; allowed values: a non-empty file name")
        self.dirpath = dirpath
        self.filename = filename
        self.saved_path: str | None = None
        self.requested_by: signal.Signals | None = None
        """The signal this callback handled (SIGUSR1 or SIGINT) that asked for the stop, if any."""
        self._previous: dict[signal.Signals, Any] = {}  # the handlers this callback replaced

    def checkpoint_path(self, trainer: L.Trainer) -> str:
        dirpath = self.dirpath
        if dirpath is None:
            model_checkpoint = next((c for c in trainer.callbacks if isinstance(c, ModelCheckpoint)), None)
            dirpath = getattr(model_checkpoint, "dirpath", None)
        if dirpath is None:
            dirpath = os.path.join(trainer.default_root_dir, "checkpoints")
        return os.path.join(dirpath, self.filename + ModelCheckpoint.FILE_EXTENSION)

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        # Lightning registers its handlers just before training starts; one already on SIGUSR1 is SLURM's
        if signal.getsignal(signal.SIGUSR1) in (signal.SIG_DFL, None):
            self._previous[signal.SIGUSR1] = signal.signal(signal.SIGUSR1, self._on_signal)
        if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
            self._previous[signal.SIGINT] = signal.signal(signal.SIGINT, self._on_signal)

    def _on_signal(self, signum, frame) -> None:
        name = signal.Signals(signum)
        self.requested_by = name
        if name == signal.SIGINT:  # a second Ctrl-C interrupts at once
            signal.signal(signal.SIGINT, self._previous.pop(signal.SIGINT))
            log.warning("Ctrl-C: saving a checkpoint at the end of this step, then stopping (again: now)")
        else:
            log.info(f"received {name.name}: saving a checkpoint at the end of this step, then stopping")

    def on_train_batch_end(self, trainer: L.Trainer, pl_module, outputs, batch, batch_idx) -> None:
        requested = trainer.received_sigterm or self.requested_by is not None
        if not trainer.strategy.reduce_boolean_decision(requested, all=False):
            return
        path = self.checkpoint_path(trainer)
        trainer.save_checkpoint(path)
        self.saved_path = path
        rank_zero_info(f"signal received: saved {path} at step {trainer.global_step}; stopping")
        trainer.should_stop = True  # SIGTERM: Lightning raises SIGTERMException right after this step

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        for signum, previous in self._previous.items():
            if signal.getsignal(signum) == self._on_signal:
                signal.signal(signum, previous if previous is not None else signal.SIG_DFL)
        self._previous = {}


def install_fault_tolerance(trainer: L.Trainer) -> None:
    """Atomic checkpoint writes (where the strategy writes through the default ``TorchCheckpointIO``)
    and, when checkpointing is on, a :class:`PreemptionCheckpoint` unless the trainer already has one."""
    strategy = trainer.strategy
    if type(strategy.checkpoint_io) is TorchCheckpointIO:
        strategy.checkpoint_io = AtomicCheckpointIO()
    has_preemption = any(isinstance(c, PreemptionCheckpoint) for c in trainer.callbacks)
    if trainer.checkpoint_callback is not None and not has_preemption:
        trainer.callbacks.append(PreemptionCheckpoint())


def rng_state() -> dict:
    """This process's torch (CPU and CUDA), Python and NumPy RNG states, as tensors and plain types
    (NumPy's key array becomes a tensor) so that ``torch.load(weights_only=True)`` reads them."""
    kind, key, position, has_gauss, cached_gauss = np.random.get_state()
    state = {
        "torch": torch.get_rng_state(),
        "python": random.getstate(),
        "numpy": (kind, torch.from_numpy(key.astype(np.int64)), position, has_gauss, cached_gauss),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    """Restore what :func:`rng_state` returned."""
    torch.set_rng_state(state["torch"])
    version, internal, gauss_next = state["python"]
    random.setstate((version, tuple(internal), gauss_next))
    kind, key, position, has_gauss, cached_gauss = state["numpy"]
    np.random.set_state((kind, key.numpy().astype(np.uint32), position, has_gauss, cached_gauss))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
