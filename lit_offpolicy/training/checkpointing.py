"""Checkpoints that survive faults: atomic writes, safe loads, and a save before a preempted run exits.

- :class:`AtomicCheckpointIO` writes each checkpoint to a temporary file in the target's directory,
  flushes it to disk (``fsync``) and renames it over the target (``os.replace``, atomic on POSIX), so
  a process killed mid-write leaves the previous checkpoint intact and never a truncated
  ``last.ckpt``. It loads with ``weights_only=True`` unless told otherwise, and a file it cannot load
  (truncated, corrupt, or holding objects that are not tensors) is one :class:`CheckpointUnreadable` line.
  A disk that fills during the write leaves the previous file too, and is one :class:`CheckpointDiskFull`
  line naming the directory and the bytes needed.
- :class:`PreemptionCheckpoint` saves ``last.ckpt`` at the end of the step during which SIGTERM,
  SIGUSR1 or Ctrl-C arrived, then stops the run (under SLURM, after requeueing the job on its
  requeue signal); ``fit --ckpt_path last`` resumes from it.

:func:`install_fault_tolerance` puts both on a Trainer; the ``lit-offpolicy`` CLI does it for every run.
:func:`training_state` / :func:`restore_training_state`: what ``OffPolicyModule`` keeps beside its weights,
the RNG states (:func:`rng_state` / :func:`set_rng_state`) included.
"""

from __future__ import annotations

import errno
import glob
import logging
import os
import pickle
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any, NoReturn

import lightning as L
import numpy as np
import torch
from lightning.fabric.plugins.environments import SLURMEnvironment
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher
from lightning.pytorch.trainer.connectors.signal_connector import _HandlersCompose, _SignalConnector
from lightning.pytorch.utilities import rank_zero_info
from lightning.pytorch.utilities.exceptions import SIGTERMException

from lit_offpolicy.core import run_signal
from lit_offpolicy.core.files import give_default_mode
from lit_offpolicy.core.messages import one_line

log = logging.getLogger(__name__)

TEMP_SUFFIX = ".tmp"


TRUST_ENV = "LIT_OFFPOLICY_TRUST_CHECKPOINT"
"""Set to 1 to load checkpoints with ``weights_only=False`` (any pickled object: only files you trust)."""


class CheckpointUnreadable(ValueError):
    """A checkpoint file that cannot be loaded; the message is one line naming it and what to do."""


class CheckpointDiskFull(OSError):
    """A checkpoint that did not fit: the disk (or a quota, or the process's file-size limit) ran out
    while it was written. The file at its path is untouched; the message is one line naming the
    directory, its free space and the bytes the checkpoint needs."""


DISK_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)


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
        """Load with ``weights_only=True`` (tensors and plain containers only) unless asked otherwise (or
        ``LIT_OFFPOLICY_TRUST_CHECKPOINT=1``); a file that does not load is :class:`CheckpointUnreadable`."""
        safe = os.environ.get(TRUST_ENV) != "1" if weights_only is None else weights_only
        try:
            return super().load_checkpoint(path, map_location=map_location, weights_only=safe)
        except (FileNotFoundError, PermissionError, IsADirectoryError):
            raise
        # what torch's zip reader, its unpickler and fsspec's file raise on a truncated or corrupt file
        except (pickle.UnpicklingError, RuntimeError, EOFError, OSError) as error:
            raise CheckpointUnreadable(unreadable_reason(Path(path), error)) from error


def unreadable_reason(path: Path, error: BaseException) -> str:
    """One line: which file, why it does not load, and what to do instead."""
    text = str(error)
    refused = re.search(r"Unsupported global: GLOBAL (\S+)", text)
    if refused:
        return (
            f"checkpoint {path} holds objects other than tensors (e.g. {refused.group(1)}), which are not "
            f"loaded (torch.load(weights_only=True) runs no pickled code); for a file you trust, run with "
            f"{TRUST_ENV}=1"
        )
    others = sorted(
        (p for p in path.parent.glob("*.ckpt") if p != path), key=lambda p: p.stat().st_mtime, reverse=True
    )
    instead = (
        f"resume from another with --ckpt_path, newest first: {', '.join(str(p) for p in others[:3])}"
        if others
        else "there is no other checkpoint in its directory: leave --ckpt_path out to start anew"
    )
    return f"checkpoint {path} is truncated or corrupt ({one_line(error, limit=120)}); {instead}"


def atomic_torch_save(obj: Any, path: Path) -> None:
    """``torch.save(obj, path)`` such that ``path`` holds either its old content or all of the new one;
    a disk that fills meanwhile is :class:`CheckpointDiskFull`."""
    path.parent.mkdir(parents=True, exist_ok=True)
    descriptor, temp_name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=TEMP_SUFFIX)
    try:
        with os.fdopen(descriptor, "wb") as file:
            torch.save(obj, file)
            file.flush()
            os.fsync(file.fileno())
        give_default_mode(temp_name)  # mkstemp made it 0600
        os.replace(temp_name, path)
    except BaseException as error:
        Path(temp_name).unlink(missing_ok=True)
        full = _disk_full(error)
        if full is not None:
            raise CheckpointDiskFull(disk_full_message(path, full, obj)) from error
        raise
    _fsync_directory(path.parent)  # make the rename itself durable


def _disk_full(error: BaseException) -> OSError | None:
    """The ENOSPC / EDQUOT / EFBIG ``OSError`` behind ``error``: torch's zip writer reports a failed write
    as a ``RuntimeError`` raised while handling the file's own ``OSError``."""
    seen: BaseException | None = error
    while seen is not None:
        if isinstance(seen, OSError) and seen.errno in DISK_FULL_ERRNOS:
            return seen
        seen = seen.__cause__ or seen.__context__
    return None


def disk_full_message(path: Path, error: OSError, obj: Any) -> str:
    """One line: which checkpoint did not fit where, the space free and needed, and what to do."""
    previous = path.stat().st_size if path.exists() else 0
    needed = max(tensor_bytes(obj), previous)  # the last save of the same state is the best estimate
    free = shutil.disk_usage(path.parent).free
    kept = f"the previous {path.name} is intact" if previous else f"no {path.name} was there before"
    return (
        f"checkpoint {path} was not written ({error.strerror}): it needs about {needed:,} bytes "
        f"({needed / 2**20:.1f} MiB) and {path.parent} has {free:,} bytes free; {kept}. Free space there "
        "or point the checkpoints elsewhere (ModelCheckpoint's dirpath), then resume with --ckpt_path last"
    )


def tensor_bytes(obj: Any) -> int:
    """The bytes of the distinct tensor storages in ``obj`` (dicts, lists and tuples searched): about
    what ``torch.save`` writes."""
    storages: dict[int, int] = {}
    stack = [obj]
    while stack:
        item = stack.pop()
        if isinstance(item, torch.Tensor):
            storage = item.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
        elif isinstance(item, dict):
            stack += item.values()
        elif isinstance(item, (list, tuple)):
            stack += item
    return sum(storages.values())


def _fsync_directory(directory: Path) -> None:
    descriptor = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


class Preempted(SIGTERMException):
    """Ends ``fit`` on every rank after :class:`PreemptionCheckpoint` saved on SIGTERM or a SLURM requeue
    signal. A ``SIGTERMException`` (so a ``SystemExit``), which Lightning handles as its own: the run
    is torn down without the ``on_train_end`` hooks. ``signum``: the signal that asked for it."""

    def __init__(self, signum: signal.Signals) -> None:
        super().__init__(128 + signum)
        self.signum = signum


class PreemptionCheckpoint(L.Callback):
    """On SIGTERM, SIGUSR1 or Ctrl-C (SIGINT), save ``last.ckpt`` at the end of the current step, then stop.

    The handlers only record the signal; at ``on_train_batch_end`` (where ``ModelCheckpoint`` saves)
    the signals are reduced over ranks and every rank saves, or none. Then:

    - SIGTERM: end the run with :class:`Preempted` (exit status 143 from the CLI); passed on to the
      ranks this process started (Lightning's local launcher).
    - SLURM's requeue signal (``SLURMEnvironment`` with ``auto_requeue``): rank 0 runs ``scontrol
      requeue`` for the job, then :class:`Preempted` (exit status 138).
    - SIGUSR1 elsewhere, and the first Ctrl-C: stop cleanly (``on_train_end`` callbacks still run;
      the CLI exits with 138 or 130); a second Ctrl-C interrupts at once.

    A handler someone else installed stays. In full: docs/reliability.md.

    Args:
        dirpath: directory of the checkpoint; None: the first ``ModelCheckpoint``'s directory, else
            ``<default_root_dir>/checkpoints``.
        filename: file name without ``.ckpt``; "last" makes ``fit --ckpt_path last`` find it.
        save: False stops the run as above without writing a checkpoint (a run with checkpointing off,
            such as the SFT warm-up: its ``HFExport`` still exports on SIGUSR1 and Ctrl-C).
    """

    def __init__(self, dirpath: str | None = None, filename: str = "last", save: bool = True) -> None:
        if not filename:
            raise ValueError("filename='' is not supported; allowed values: a non-empty file name")
        self.dirpath = dirpath
        self.filename = filename
        self.save = save
        self.saved_path: str | None = None
        self.requested_by: signal.Signals | None = None
        """The signal that asked for the stop (the weightiest, when several arrived), if any."""
        self._previous: dict[signal.Signals, Any] = {}  # the handlers this callback replaced
        self._chained: list[Any] = []  # earlier SIGTERM handlers that Lightning's handler called
        self._requeue_signal: signal.Signals | None = None
        self._launcher = None
        self._tells = True

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
        # what Lightning's signal connector reads: single-device strategies keep no environment
        environment = trainer._accelerator_connector.cluster_environment
        if isinstance(environment, SLURMEnvironment) and environment.auto_requeue:
            self._requeue_signal = signal.Signals(environment.requeue_signal or signal.SIGUSR1)
        self._launcher = trainer.strategy.launcher
        self._tells = trainer.is_global_zero  # a Ctrl-C reaches every rank: one line, from rank 0
        # Lightning registered its handlers just before training started. They save and broadcast inside
        # the handler, wherever in the step the signal lands: a collective there meets a different one on
        # another rank (a hang, or a checkpoint of half a step). So they are replaced for the training,
        # and the saving waits for on_train_batch_end. A handler someone else installed stays: only
        # Python's default and Lightning's are taken over (Lightning's SIGTERM handler chains earlier
        # handlers; those still run).
        for signum in {signal.SIGTERM, signal.SIGUSR1, self._requeue_signal or signal.SIGUSR1}:
            current = signal.getsignal(signum)
            if current in (signal.SIG_DFL, None) or isinstance(current, _HandlersCompose):
                if signum == signal.SIGTERM and isinstance(current, _HandlersCompose):
                    self._chained = [h for h in current.signal_handlers if not _is_lightnings(h)]
                self._previous[signum] = signal.signal(signum, self._on_signal)
        if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
            self._previous[signal.SIGINT] = signal.signal(signal.SIGINT, self._on_signal)

    @property
    def _at_step_end(self) -> str:
        return "saving a checkpoint at the end of this step" if self.save else "finishing this step"

    def _on_signal(self, signum, frame) -> None:
        name = signal.Signals(signum)
        if self._weight(name) > self._weight(self.requested_by):
            self.requested_by = name
        run_signal.note()
        if name == signal.SIGINT:  # a second Ctrl-C interrupts at once
            signal.signal(signal.SIGINT, self._interrupt_now)
            if self._tells:
                log.warning(f"Ctrl-C: {self._at_step_end}, then stopping (again: now)")
            return
        if self._tells:
            log.info(f"received {name.name}: {self._at_step_end}, then stopping")
        if name == signal.SIGTERM:
            if isinstance(self._launcher, _SubprocessScriptLauncher):
                self._launcher.kill(signum)  # the ranks this process started (Lightning's local DDP)
            for handler in self._chained:
                handler(signum, frame)

    def _interrupt_now(self, signum, frame) -> NoReturn:
        """The second Ctrl-C: KeyboardInterrupt at once, recorded so that the CLI exits 130 in one line
        (``second_ctrl_c``) instead of Lightning's status 1 for an interrupted fit."""
        global _interrupted_now
        _interrupted_now = self
        raise KeyboardInterrupt

    def _weight(self, name: signal.Signals | None) -> int:
        """What the signal asks for, as its precedence in ``_WEIGHT`` (0: nothing)."""
        if name is None:
            return 0
        if name == signal.SIGTERM:
            return _WEIGHT["terminate"]
        return _WEIGHT["requeue" if name == self._requeue_signal else "stop"]

    def on_train_batch_end(self, trainer: L.Trainer, pl_module, outputs, batch, batch_idx) -> None:
        mine = torch.tensor(self._weight(self.requested_by), device=trainer.strategy.root_device)
        weight = int(trainer.strategy.reduce(mine, reduce_op="max"))  # what any rank asked for
        if weight == 0:
            return
        action = next(a for a, w in _WEIGHT.items() if w == weight)
        if action != "stop":  # the raise below skips Lightning's logging of this step's metrics: now
            trainer._logger_connector.update_train_step_metrics()
        self._save(trainer, "stopping")  # every rank; ends with a barrier
        if action == "stop":
            trainer.should_stop = True
            return
        if action == "requeue":
            if trainer.is_global_zero:
                requeue_slurm_job()
            raise Preempted(self._requeue_signal)
        raise Preempted(signal.SIGTERM)

    def stop_now(self, trainer: L.Trainer, broken_by: BaseException) -> NoReturn:
        """Save ``last.ckpt`` and end the run as the signal received asks, from inside a step that
        something else the signal ended broke (``broken_by``: the rollout servers, whose watchdogs are
        in the run's process group); exit 128 + the signal, as at a step's end. One rank only.

        The loop's progress is saved as at the last step's end: Lightning counts the broken step's batch
        as fetched, and a run restored from a batch fetched but not started counts it as stepped (the
        resumed run would log each step one index late and end a step early)."""
        progress = trainer.fit_loop.epoch_loop.batch_progress
        progress.total.ready, progress.current.ready = progress.total.started, progress.current.started
        self._save(trainer, f"stopping ({broken_by})")
        if self._weight(self.requested_by) == _WEIGHT["requeue"]:
            requeue_slurm_job()
        raise Preempted(self.requested_by)

    def _save(self, trainer: L.Trainer, then: str) -> None:
        """Write out what the loggers hold (the last finished step's metrics: the run ends without their
        ``finalize``); save ``last.ckpt`` (adopted by the ``ModelCheckpoint`` that keeps it) where
        ``save``; say so."""
        for logger in trainer.loggers:
            logger.save()
        if not self.save:
            _say(
                trainer,
                f"signal received: checkpointing is off, nothing saved at {step_label(trainer)}; {then}",
            )
            return
        path = self.checkpoint_path(trainer)
        _adopt_as_last(trainer, path)
        trainer.save_checkpoint(path)
        self.saved_path = path
        _say(trainer, f"signal received: saved {path} at {step_label(trainer)}; {then}")

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        for signum, previous in self._previous.items():
            if signal.getsignal(signum) in (self._on_signal, self._interrupt_now):
                signal.signal(signum, previous if previous is not None else signal.SIG_DFL)
        self._previous, self._chained, self._launcher = {}, [], None


def stopping_signal(trainer: L.Trainer | None) -> signal.Signals | None:
    """The signal (Ctrl-C's SIGINT, or SIGUSR1) that stopped the run after ``PreemptionCheckpoint``
    saved it; None when none did (SIGTERM ends the run with Lightning's ``SIGTERMException``)."""
    for callback in trainer.callbacks if trainer is not None else []:
        if isinstance(callback, PreemptionCheckpoint) and callback.requested_by is not None:
            return callback.requested_by
    return None


def step_label(trainer: L.Trainer) -> str:
    """ "step N" (optimizer steps, ``trainer.max_steps``' unit), with the RL step where it differs (the
    progress bar counts RL steps): "step 6 (RL step 3)"."""
    rl_step = getattr(trainer.lightning_module, "policy_version", None)
    rl = f" (RL step {int(rl_step)})" if rl_step is not None and int(rl_step) != trainer.global_step else ""
    return f"step {trainer.global_step}{rl}"


_interrupted_now: PreemptionCheckpoint | None = None


def second_ctrl_c() -> str | None:
    """What a second Ctrl-C left, in one line, if one stopped the run at once; None otherwise."""
    if _interrupted_now is None:
        return None
    if _interrupted_now.saved_path:
        return f"a second Ctrl-C stopped the run at once, after {_interrupted_now.saved_path} was saved"
    return (
        "a second Ctrl-C stopped the run at once: nothing of the current step was saved "
        "(`fit --ckpt_path last` resumes from the last checkpoint, if any)"
    )


# what a signal asks for, by precedence: when ranks (or one rank) got several, the weightiest wins
_WEIGHT = {"stop": 1, "requeue": 2, "terminate": 3}


def _adopt_as_last(trainer: L.Trainer, path: str) -> None:
    """Make ``path`` the last checkpoint of the ``ModelCheckpoint`` that would save ``last.ckpt`` there.
    Recorded in the checkpoint, it lets that callback overwrite the file in the resumed run; without
    it, the callback took the file for someone else's and saved ``last-v1.ckpt`` beside it. It also
    counts as that callback's save at this step: a run that stops cleanly (Ctrl-C, SIGUSR1) ends its
    epoch, and the callback saved ``last.ckpt`` again there (at the end of the epoch and of training),
    with the epoch counted as finished: the resumed run began the next epoch's prompts."""
    for callback in trainer.checkpoint_callbacks:
        if not isinstance(callback, ModelCheckpoint) or not callback.save_last or callback.dirpath is None:
            continue
        own_last = os.path.join(callback.dirpath, callback.CHECKPOINT_NAME_LAST + callback.FILE_EXTENSION)
        if os.path.abspath(own_last) == os.path.abspath(path):
            callback.last_model_path = path
            # Lightning's own record of its saves (model_checkpoint.py: _should_skip_saving_checkpoint,
            # on_train_end): the step is saved, and so is the last checkpoint
            callback._last_global_step_saved = trainer.global_step
            callback._last_checkpoint_saved = path


RUN_STAMP = "%Y%m%d-%H%M%S"
"""How a run's start is written in the names it leaves (``checkpoints.earlier-20261129-051200``)."""
KEEP_EARLIER_CHECKPOINTS = 3
"""How many earlier runs' checkpoints set aside stay (``--keep_earlier_checkpoints``)."""


def set_aside_earlier_checkpoints(trainer: L.Trainer, stamp: str, keep: int) -> list[str]:
    """A new run's checkpoint directories keep no earlier run's ``*.ckpt``: they move to
    ``<dirpath>.earlier-<stamp>/`` beside it. Lightning alone saved ``last-v1.ckpt`` beside them, and a
    save on a signal wrote ``last.ckpt`` over the earlier run's. Of those set aside, the ``keep`` newest
    stay (0: all): a dozen runs left hundreds of MB. Global rank 0 only; one line per move or removal."""
    if trainer.global_rank != 0:
        return []
    notes = []
    for callback in trainer.checkpoint_callbacks:
        if not isinstance(callback, ModelCheckpoint) or callback.dirpath is None:
            continue
        directory = Path(callback.dirpath)
        earlier = sorted(directory.glob("*.ckpt"))
        if not earlier:
            continue
        newest = max(earlier, key=lambda path: path.stat().st_mtime).name
        aside = directory.with_name(f"{directory.name}.earlier-{stamp}")
        aside.mkdir(parents=True, exist_ok=False)
        for path in earlier:
            path.rename(aside / path.name)
        notes.append(
            f"lit-offpolicy: {directory} held an earlier run's {len(earlier)} checkpoint(s), moved to "
            f"{aside} (resume that run with --ckpt_path {aside / newest}; --ckpt_path last resumes the run "
            "in the directory instead of starting anew)"
        )
        notes += _remove_older_than(directory, keep)
    return notes


def _remove_older_than(directory: Path, keep: int) -> list[str]:
    """Remove ``<directory>.earlier-*`` past the ``keep`` newest (0: none); one line if any went."""
    aside = sorted(directory.parent.glob(f"{glob.escape(directory.name)}.earlier-*"))
    older = aside[:-keep] if keep else []
    for path in older:
        shutil.rmtree(path, ignore_errors=True)
    if not older:
        return []
    names = ", ".join(path.name for path in older)
    return [
        f"lit-offpolicy: removed {len(older)} older run(s)' checkpoints ({names}): the {keep} newest set "
        "aside stay (--keep_earlier_checkpoints N keeps N; 0 keeps all)"
    ]


def _is_lightnings(handler: Any) -> bool:
    return isinstance(getattr(handler, "__self__", None), _SignalConnector)


def requeue_slurm_job() -> None:
    """``scontrol requeue`` this SLURM job (an array job by its array ids); a warning if that fails.

    The requeue sends SIGTERM to the job's processes, ``scontrol`` among them: it ignores it, so that it
    reports the requeue it made instead of ending with status −15 (which made the run warn that the
    requeue failed while the job was being requeued, on a loaded machine)."""
    array_job = os.environ.get("SLURM_ARRAY_JOB_ID")
    job = f"{array_job}_{os.environ['SLURM_ARRAY_TASK_ID']}" if array_job else os.environ["SLURM_JOB_ID"]
    try:
        result = subprocess.run(
            ["scontrol", "requeue", job],
            capture_output=True,
            text=True,
            timeout=60,
            preexec_fn=_ignore_sigterm,
        )
    except (OSError, subprocess.TimeoutExpired) as error:
        log.warning(f"could not requeue SLURM job {job}: {error}; resume with --ckpt_path last")
        return
    if result.returncode != 0:
        reason = result.stderr.strip() or f"exit status {result.returncode}"
        log.warning(f"could not requeue SLURM job {job}: {reason}; resume with --ckpt_path last")
        return
    rank_zero_info(f"requeued SLURM job {job}")


def _ignore_sigterm() -> None:
    """In the child, before ``exec``: SIGTERM ignored (inherited by the program it runs)."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)


def install_fault_tolerance(trainer: L.Trainer) -> None:
    """Atomic checkpoint writes (where the strategy writes through the default ``TorchCheckpointIO``)
    and a :class:`PreemptionCheckpoint` unless the trainer already has one: it saves where checkpointing
    is on, and stops the run at the step's end either way."""
    strategy = trainer.strategy
    if type(strategy.checkpoint_io) is TorchCheckpointIO:
        strategy.checkpoint_io = AtomicCheckpointIO()
    if not any(isinstance(c, PreemptionCheckpoint) for c in trainer.callbacks):
        trainer.callbacks.append(PreemptionCheckpoint(save=trainer.checkpoint_callback is not None))


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


TRAINING_STATE = ("kl_ctl", "reward_moments", "nonfinite_guard")
"""The RL module's attributes (each with ``state_dict``/``load_state_dict``) a checkpoint keeps."""


def training_state(module: L.LightningModule) -> dict:
    """What a checkpoint keeps of the RL module beside its weights: its ``policy_version``, the state of
    each of ``TRAINING_STATE`` and this process's RNG states (``rng_state``)."""
    states = {name: getattr(module, name).state_dict() for name in TRAINING_STATE}
    return {"policy_version": module.policy_version, **states, "rng": rng_state()}


def restore_training_state(module: L.LightningModule, state: dict) -> dict | None:
    """Put ``training_state``'s ``state`` back on ``module`` (what it lacks: policy version 0, the rest
    as built); return its RNG states (None: none saved), for ``set_rng_state`` once Lightning has set up
    the data loaders: the first resumed step then starts from the RNG state at which the run saved."""
    module.policy_version = state.get("policy_version", 0)
    for name in TRAINING_STATE:
        if name in state:
            getattr(module, name).load_state_dict(state[name])
    return state.get("rng")


def _say(trainer: L.Trainer, message: str) -> None:
    """``lit-offpolicy: MESSAGE`` on stderr from rank 0, on a line of its own (after the progress bar's)."""
    if trainer.is_global_zero:
        print(f"\nlit-offpolicy: {message}", file=sys.stderr, flush=True)
