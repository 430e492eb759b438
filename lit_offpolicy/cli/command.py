"""The ``lit-offpolicy`` command: LightningCLI over the RL module (or the SFT warm-up) and prompt data.

lit-offpolicy fit --config configs/grpo.yaml
lit-offpolicy fit --config configs/sft_tiny.yaml
lit-offpolicy create-tiny-model outputs/tiny [--seed 0] [--arch qwen3]   # a tiny model + tokenizer, offline
"""

from __future__ import annotations

import argparse
import importlib
import json
import math
import os
import signal
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import NoReturn

import lightning as L
import yaml
from jsonargparse import Namespace, set_parsing_settings, strip_meta
from lightning.pytorch.callbacks import ModelCheckpoint, ModelSummary, ProgressBar
from lightning.pytorch.cli import LightningCLI
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger
from lightning.pytorch.utilities.exceptions import SIGTERMException

from lit_offpolicy.callbacks import HFExport, Rollout, StepProgress
from lit_offpolicy.callbacks.progress import rl_step_size
from lit_offpolicy.cli.console import OneLineModelSummary, quiet_lightning
from lit_offpolicy.cli.parser_errors import TRACEBACK_ENV, OneLineErrorParser, broken_config_file, condense
from lit_offpolicy.cli.preflight import (
    check_frozen_models_are_not_written,
    check_model_directories,
)
from lit_offpolicy.cli.rank_zero import note_rank_zero, rank_zero_reason, tell_rank_zero_gone, watch_rank_zero
from lit_offpolicy.core.distributed import barrier, destroy_process_group, peer_gone
from lit_offpolicy.core.distributed import rank as distributed_rank
from lit_offpolicy.core.stacks import stacks_on_crash, stacks_on_sigusr2
from lit_offpolicy.core.threads import choose_threads
from lit_offpolicy.data import PromptDataModule
from lit_offpolicy.data.prepare import prepare_gsm8k
from lit_offpolicy.models import TINY_ARCHS, create_tiny_model
from lit_offpolicy.rewards import RewardContractError
from lit_offpolicy.rollout import EngineLimitError, EngineRefused, ServerError, ServersLostError
from lit_offpolicy.rollout.buffer import ProducerError, ProducerStalled
from lit_offpolicy.training import sequence_parallel
from lit_offpolicy.training.checkpointing import (
    KEEP_EARLIER_CHECKPOINTS,
    RUN_STAMP,
    CheckpointDiskFull,
    CheckpointUnreadable,
    Preempted,
    install_fault_tolerance,
    second_ctrl_c,
    set_aside_earlier_checkpoints,
    stopping_signal,
)
from lit_offpolicy.training.checks import CheckpointMismatch, check_token_budget

DESCRIPTION = (
    "lit-offpolicy: off-policy RL for language models on Lightning. Subcommands: fit (see fit --help), "
    "create-tiny-model DIRECTORY [--arch NAME] [--seed N] [--overwrite] (writes a tiny model, the "
    "built-in Llama by default, offline; see create-tiny-model --help), and prepare-data gsm8k --input "
    "FILE --output DIR (a GSM8K file as train/val parquet; see prepare-data --help)."
)


ROLLOUT_PREFIX = "--rollout."
"""``--rollout.FIELD VALUE`` sets a field of the Rollout callback in ``trainer.callbacks``."""

FIT_HELP = (
    "Train. Options users change most (each also a YAML key; --print_config shows them all): "
    "--model.init_args.model_path DIR, --model.init_args.optim.lr, --model.init_args.policy_loss NAME, "
    "--model.init_args.advantage NAME, --model.init_args.kl.loss_coef, --data.train_files, --data.val_files, "
    "--data.batch_size (prompts per step), --data.max_prompt_length, --trainer.max_steps, "
    "--rollout.sampling.n, --rollout.sampling.max_tokens, --rollout.sampling.temperature, "
    "--rollout.reward.fn, "
    "--rollout.validation.every_n_steps, --rollout.validation.stop_at (--rollout.FIELD sets a field of the "
    "Rollout in trainer.callbacks). All of the module's fields: --model.help lit_offpolicy.OffPolicyModule; "
    "all of the Rollout's: --trainer.callbacks.help Rollout."
)


ROLLOUT_FAILURES = (EngineLimitError, EngineRefused, ServerError, ServersLostError, ProducerStalled)
"""Rollout failures told in one line (exit 2): a prompt too long for the engine, a model it cannot run;
a rollout server that did not start or answer, a request that failed on healthy servers, every server
lost; an async producer that made no progress."""


def prints_descriptions(command: list[str]) -> bool:
    """Whether ``command`` prints the options' descriptions (``-h``, ``--help``, ``--X.help CLASS``).
    Only then are the option groups' field docstrings read (each group is a dataclass that documents a
    field in a docstring below it): reading them parses the classes' source, about 0.6 s of each
    start-up that prints none of it."""
    names = [argument.split("=", 1)[0] for argument in command]
    return any(name in ("-h", "--help") or name.endswith(".help") for name in names)


class OffPolicyCLI(LightningCLI):
    """LightningCLI whose model is any LightningModule given by ``class_path`` (OffPolicyModule, SFTModule).

    A bad setting found while building the objects (a ValueError naming the option, a missing model
    directory) ends the command with that message and exit status 2, without a traceback; set
    ``LIT_OFFPOLICY_TRACEBACK=1`` to see it.

    Every trainer writes checkpoints atomically and saves ``last.ckpt`` when SIGTERM or SIGUSR1
    arrives (``lit_offpolicy.training.checkpointing.install_fault_tolerance``).

    ``--ckpt_path FILE`` resumes with the options of the command line: the checkpoint gives the
    state (weights, optimizer, step, ...), not the options.
    """

    @staticmethod
    def subcommands() -> dict[str, set[str]]:
        """``fit`` alone of Lightning's subcommands: no module here has a validation, test or predict
        step (evaluation runs in the Rollout callback during fit), so ``validate``, ``test`` and
        ``predict`` could only end in Lightning's traceback; and each one's parser was built at every
        start-up (a command's parsing: 0.32 s with them, 0.20 s without)."""
        return {"fit": LightningCLI.subcommands()["fit"]}

    def add_arguments_to_parser(self, parser) -> None:
        parser.add_argument(
            "--keep_earlier_checkpoints",
            type=int,
            default=KEEP_EARLIER_CHECKPOINTS,
            help="A new run sets an earlier run's checkpoints aside (<dirpath>.earlier-<time>); this many of "
            "those, the newest, stay (0: all)",
        )

    def _parse_ckpt_path(self) -> None:
        """Leave the options alone. LightningCLI parses a checkpoint file's hyperparameters back into
        the model's options; with the model given by ``class_path`` (subclass mode) they carry no
        class path, parse against ``LightningModule`` and fail, so every ``fit --ckpt_path FILE``
        ended with "Parsing of ckpt_path hyperparameters failed!" before the resume."""

    def parse_arguments(self, parser, args) -> None:
        """``--rollout.FIELD VALUE`` (``--rollout.sampling.n 8``, ``--rollout.reward.fn exact``) sets a
        field of the Rollout (or AsyncRollout) in ``trainer.callbacks``, wherever it sits in the list:
        the command line is parsed once without them, the callback's entry updated, then parsed again
        with that list. jsonargparse's own ``--trainer.callbacks.FIELD`` reaches only the last callback."""
        given = sys.argv[1:] if args is None else list(args)
        rest, options = _split_rollout_options(given)
        if not options or isinstance(args, (dict, Namespace)):
            super().parse_arguments(parser, args)
            return
        printing = [arg for arg in rest if arg.startswith("--print_config")]
        rest = [arg for arg in rest if not arg.startswith("--print_config")]
        config = parser.parse_args(rest)
        given_callbacks = _as_list(config[config.subcommand].trainer.callbacks)
        callbacks = [strip_meta(entry).as_dict() for entry in given_callbacks]
        found = [entry for entry in callbacks if _is_rollout(entry.get("class_path"))]
        if not found:
            exit_with_error(f"{options[0][0]}: trainer.callbacks has no Rollout or AsyncRollout to set it on")
        for option, value in options:
            entry = found[0].setdefault("init_args", {})
            *parents, leaf = option.removeprefix("--rollout.").split(".")
            for key in parents:
                if not isinstance(entry.get(key), dict):
                    entry[key] = {}
                entry = entry[key]
            entry[leaf] = yaml.safe_load(value)
        listed = json.dumps(callbacks, default=str)
        # an empty list first: parsed over the config files' list, jsonargparse would merge each entry with
        # the one before it (an engine given whole by class_path kept the init_args of the one it replaces)
        replaced = ["--trainer.callbacks", "[]", "--trainer.callbacks", listed]
        self.config = parser.parse_args([*rest, *replaced, *printing])

    def instantiate_classes(self) -> None:
        with _one_line_errors():
            self._check_output_options()
            self._check_data_options()
            self._check_model_options()
            super().instantiate_classes()

    def _check_output_options(self) -> None:
        """Every output directory named in the config (callbacks' ``dirpath``, the logger's ``save_dir``,
        ``trainer.default_root_dir``) can be written, checked before the model loads; the built trainer's
        directories, defaults included, are checked again in ``instantiate_trainer``."""
        config = self.config.get(str(self.subcommand), self.config)
        for option, directory in _configured_output_directories(config.get("trainer")):
            reason = _unwritable_reason(Path(directory))
            if reason is not None:
                raise ValueError(f"{option}={directory} cannot be written: {reason}")

    def _check_data_options(self) -> None:
        """Build the data module once from its options, and read the first row of each data file,
        before the model loads: LightningCLI builds the model first, and loading a large one takes
        minutes that a bad data option or file would waste."""
        config = self.config.get(str(self.subcommand), self.config)
        data = config.get("data")
        if isinstance(data, Namespace) and "class_path" not in data:
            self.datamodule_class(**strip_meta(data).as_dict()).check_files()

    def _check_model_options(self) -> None:
        """Before anything is built (a judge or a model loaded): every model directory the config names
        exists locally, and no frozen model is read from a directory the run writes
        (``lit_offpolicy.cli.preflight``)."""
        config = self.config.get(str(self.subcommand), self.config)
        written = [
            (option, directory)
            for option, directory in _configured_output_directories(config.get("trainer"))
            if option.endswith((".dirpath", ".run_name"))
        ]
        check_model_directories(config)
        check_frozen_models_are_not_written(config, written)

    def instantiate_trainer(self, **kwargs) -> L.Trainer:
        # before the Trainer is built: it appends its default progress bar to the configured list
        given = _as_list(self._get(self.config_init, "trainer", default={}).get("callbacks") or [])
        user_chose_a_bar = any(isinstance(callback, ProgressBar) for callback in given)
        trainer = super().instantiate_trainer(**kwargs)
        _check_output_directories(trainer)
        install_fault_tolerance(trainer)
        if not user_chose_a_bar:
            _count_steps_in_progress_bar(trainer)
        if not any(isinstance(callback, ModelSummary) for callback in given):
            _summarize_in_one_line(trainer)
        return trainer

    def _run_subcommand(self, subcommand: str) -> None:
        """A reward function that breaks the contract ends the run with one line (exit status 2): it is
        a bug in the user's function, found at the first batch it scores."""
        try:
            super()._run_subcommand(subcommand)
        except RewardContractError as error:
            if os.environ.get(TRACEBACK_ENV):
                raise
            exit_with_error(f"{getattr(error, 'option', 'reward.fn')}: {error}", agreed=_agreed(error))
        # --ckpt_path of another configuration, or a file that does not load (truncated, corrupt, objects);
        # a checkpoint that did not fit on the disk
        except (CheckpointMismatch, CheckpointUnreadable, CheckpointDiskFull) as error:
            if os.environ.get(TRACEBACK_ENV):
                raise
            exit_with_error(str(error))
        except ROLLOUT_FAILURES as error:
            if os.environ.get(TRACEBACK_ENV):
                raise
            exit_with_error(str(error), agreed=_agreed(error))
        except ProducerError as error:  # the async producer's, of those kinds
            if os.environ.get(TRACEBACK_ENV) or not isinstance(error.__cause__, ROLLOUT_FAILURES):
                raise
            exit_with_error(str(error.__cause__))

    def before_fit(self) -> None:
        """Refuse ``--ckpt_path last`` with nothing to resume; choose torch's threads for the model's
        size (``core.threads``); hand the model's tokenizer to the data module when it has none of its
        own; check what only the built parts can tell; then, every check passed, a new run sets an
        earlier run's checkpoints aside (``set_aside_earlier_checkpoints``)."""
        self._check_resume()
        _choose_threads(self.model, self.trainer)
        datamodule = self.datamodule
        if isinstance(datamodule, PromptDataModule):
            if datamodule.tokenizer is None and datamodule.tokenizer_path is None:
                datamodule.set_tokenizer(self.model.tokenizer)
            # read and tokenize the prompts now, so that what only the tokenizer can tell (chat
            # messages without a chat template, every prompt too long, fewer prompts than a batch)
            # ends with one line before training; Lightning's own `setup` call finds them ready
            with _one_line_errors():
                datamodule.setup("fit")
                _check_update_sizes(self.model, datamodule, self.trainer)
                _size_engines(self.model, datamodule, self.trainer)
            _print_step_count(self.model, datamodule, self.trainer)
        with _one_line_errors():  # before the ranks start (each would raise it in setup)
            _check_sequence_parallel(self.model, self.trainer)
        config = self.config.get(str(self.subcommand), self.config)
        if config.get("ckpt_path") is None:
            keep = config.get("keep_earlier_checkpoints", KEEP_EARLIER_CHECKPOINTS)
            for note in set_aside_earlier_checkpoints(self.trainer, time.strftime(RUN_STAMP), keep):
                print(note, file=sys.stderr, flush=True)
        _print_destinations(self.trainer)

    def _check_resume(self) -> None:
        """``--ckpt_path last`` where no ``last.ckpt`` exists ends with one line and exit status 2:
        Lightning would warn and train from scratch, and a run meant to resume would start over."""
        config = self.config.get(str(self.subcommand), self.config)
        if config.get("ckpt_path") != "last":
            return
        checkpointers = [c for c in self.trainer.checkpoint_callbacks if isinstance(c, ModelCheckpoint)]
        if any(c._find_last_checkpoints(self.trainer) for c in checkpointers):
            return
        where = ", ".join(str(c.dirpath) for c in checkpointers) or "none: checkpointing is off"
        exit_with_error(
            f"--ckpt_path last: no last checkpoint to resume from (checkpoint directory: {where}); "
            "leave --ckpt_path out to start a new run"
        )


def _split_rollout_options(command: list[str]) -> tuple[list[str], list[tuple[str, str]]]:
    """The command without its ``--rollout.FIELD VALUE`` (or ``=VALUE``) pairs, and those pairs."""
    rest, options, index = [], [], 0
    while index < len(command):
        argument = command[index]
        if argument.startswith(ROLLOUT_PREFIX):
            option, equals, value = argument.partition("=")
            if not equals:
                if index + 1 >= len(command):
                    exit_with_error(f"{option}: expected a value (--rollout.FIELD VALUE)")
                index += 1
                value = command[index]
            options.append((option, value))
        else:
            rest.append(argument)
        index += 1
    return rest, options


def _is_rollout(class_path: str | None) -> bool:
    """Whether a ``class_path`` names ``Rollout`` or a subclass of it (``AsyncRollout``)."""
    if not class_path:
        return False
    module, _, name = class_path.rpartition(".")
    try:
        return issubclass(getattr(importlib.import_module(module), name), Rollout)
    except (ImportError, AttributeError, TypeError):
        return False


def _check_update_sizes(model: L.LightningModule, datamodule: PromptDataModule, trainer: L.Trainer) -> None:
    """``update.mini_batch_size`` above the samples of a step (``data.batch_size`` prompts ×
    ``sampling.n``, per rank) would quietly mean one mini-batch: a setting that does not do what it
    says is refused."""
    update = getattr(model, "update_options", None)
    rollouts = [callback for callback in trainer.callbacks if isinstance(callback, Rollout)]
    if update is None or not rollouts:
        return
    _check_token_budget(update.max_tokens_per_micro_batch, datamodule, rollouts[0])
    if update.mini_batch_size is None:
        return
    n, ranks = rollouts[0].worker.sampling.n, update.sequence_parallel  # a sequence group's ranks
    samples = datamodule.batch_size * n * ranks
    if update.mini_batch_size > samples:
        group = "" if ranks == 1 else f" x update.sequence_parallel={ranks} ranks"
        per = "per rank" if ranks == 1 else "per sequence group"
        raise ValueError(
            f"update.mini_batch_size={update.mini_batch_size} is more than a step's samples: "
            f"data.batch_size={datamodule.batch_size} prompts x sampling.n={n}{group} = {samples} {per}; "
            f"set it to at most {samples}, or null (the whole step)"
        )


def _check_sequence_parallel(model: L.LightningModule, trainer: L.Trainer) -> None:
    """``update.sequence_parallel`` against the strategy, ``compile``, the models and the world size."""
    update = getattr(model, "update_options", None)
    if update is not None and update.sequence_parallel > 1:
        models = [getattr(model, name, None) for name in ("actor", "critic", "reference", "teacher")]
        compiling, world = getattr(model, "compile_enabled", False), trainer.world_size
        sequence_parallel.check(update.sequence_parallel, models, trainer.strategy, compiling, world)


def _check_token_budget(budget: int | None, datamodule: PromptDataModule, rollout: Rollout) -> None:
    """``update.max_tokens_per_micro_batch`` below the longest sample the run can make would stop it at
    the first step that makes one: checked now against ``data.max_prompt_length`` + the longest response."""
    check_token_budget(budget, datamodule.max_prompt_length, *rollout.worker.longest_response)


def _choose_threads(model: L.LightningModule, trainer: L.Trainer) -> None:
    """Torch's threads for the size of the model trained (the actor, where there is one), said in one line."""
    line = choose_threads(getattr(model, "actor", model))
    if line is not None and trainer.global_rank == 0:
        print(f"lit-offpolicy: {line}")


def _print_step_count(model: L.LightningModule, datamodule: PromptDataModule, trainer: L.Trainer) -> None:
    """Say in one line how many optimizer steps (what ``trainer.max_steps`` counts) an RL step makes,
    where it is more than one."""
    per_step = rl_step_size(model, datamodule, trainer.callbacks)
    if trainer.global_rank != 0 or per_step is None or per_step == 1:
        return
    update = model.update_options
    minis = per_step // update.ppo_epochs
    about = (
        f", so about {math.ceil(trainer.max_steps / per_step)} RL step(s)" if trainer.max_steps > 0 else ""
    )
    print(
        f"lit-offpolicy: trainer.max_steps={trainer.max_steps} counts optimizer steps; an RL step makes "
        f"up to {per_step} (update.ppo_epochs={update.ppo_epochs} x {minis} mini-batch(es) of "
        f"update.mini_batch_size={update.mini_batch_size}){about}"
    )


def _size_engines(model: L.LightningModule, datamodule: PromptDataModule, trainer: L.Trainer) -> None:
    """Fit each rollout engine's length limit to ``data.max_prompt_length`` and the response length
    now, before the engine loads: what cannot fit (vLLM's ``max_model_len``) ends with one line."""
    for callback in trainer.callbacks:
        if isinstance(callback, Rollout) and getattr(model, "model_path", None):
            callback.worker.size_engine(datamodule.max_prompt_length, model.model_path)


def exit_with_error(message: str, agreed: bool = False) -> NoReturn:
    """End the command with ``lit-offpolicy: error: MESSAGE`` on stderr and exit status 2.

    ``agreed``: a failure that every trainer rank raised together (``callbacks.rollout.
    saves_last_when_stopped``). Rank 0 alone prints it; the other ranks exit after it, since a
    launcher ends every rank as soon as one exits with an error (Lightning's SIGKILLs rank 0, torchrun's
    and srun's likewise), which could take rank 0 before its line (``leave_after_rank_zero``)."""
    if not agreed or distributed_rank() == 0:
        print(f"lit-offpolicy: error: {message}", file=sys.stderr, flush=True)
    if agreed:
        leave_after_rank_zero()
    raise SystemExit(2)


def _agreed(error: BaseException) -> bool:
    return getattr(error, "agreed_by_ranks", False)


def leave_after_rank_zero(timeout_s: float = 10.0) -> None:
    """At the end of a run that every rank ends together (an agreed failure, ``Preempted``): meet the
    other ranks (rank 0 has said why); then a rank other than 0 waits until rank 0 has ended, seen
    where rank 0 is its parent (Lightning's local launcher), else ``timeout_s``. Its own exit status
    then cannot end rank 0 early (Lightning's launcher SIGKILLs every rank once one exits non-zero).
    A rank that another has already left goes too: SLURM's requeue, which rank 0 asked for, ends
    every task of the job at once (once rank 0's barrier then failed: exit 1, not 138)."""
    try:
        barrier()
    except RuntimeError as error:
        if peer_gone(error) is None:
            raise
        return
    if distributed_rank() == 0:
        return
    parent, deadline = os.getppid(), time.monotonic() + timeout_s
    while os.getppid() == parent and time.monotonic() < deadline:
        time.sleep(0.05)


@contextmanager
def _one_line_errors() -> Iterator[None]:
    """A bad setting (a ValueError naming the option, a missing or unreadable file) raised in the
    block ends the command with its message, without a traceback unless ``TRACEBACK_ENV`` is set."""
    try:
        yield
    except (ValueError, OSError) as error:
        if os.environ.get(TRACEBACK_ENV):
            raise
        exit_with_error(_reason(error))


def _check_output_directories(trainer: L.Trainer) -> None:
    """Every directory the run will write (the callbacks' ``dirpath``, the logger's ``save_dir``)
    can be created and written now, not only at the first checkpoint, hours and steps later."""
    places = [(callback, "dirpath") for callback in trainer.callbacks]
    places.append((trainer.logger, "save_dir"))
    for owner, attribute in places:
        directory = getattr(owner, attribute, None)
        reason = _unwritable_reason(Path(directory)) if directory else None
        if reason is not None:
            raise ValueError(f"{type(owner).__name__}.{attribute}={directory} cannot be written: {reason}")


def _configured_output_directories(trainer: Namespace | None) -> Iterator[tuple[str, str]]:
    """(option, directory) for each output directory the trainer's config names."""
    if not isinstance(trainer, Namespace):
        return
    if trainer.get("default_root_dir"):
        yield "trainer.default_root_dir", str(trainer.default_root_dir)
    for key, attribute in (("logger", "save_dir"), ("callbacks", "dirpath")):
        for entry in _as_list(trainer.get(key)):
            init_args = entry.get("init_args") if isinstance(entry, Namespace) else None
            directory = init_args.get(attribute) if isinstance(init_args, Namespace) else None
            if directory:
                yield f"{entry.class_path.rsplit('.', 1)[-1]}.{attribute}", str(directory)
            run_name = init_args.get("run_name") if isinstance(init_args, Namespace) else None
            if directory and run_name:  # HFExport's own place for a named run
                yield f"{entry.class_path.rsplit('.', 1)[-1]}.run_name", f"{directory}.runs/{run_name}"


def _unwritable_reason(directory: Path) -> str | None:
    """Why ``directory`` (existing or to be created) cannot be written to, or None if it can."""
    existing = directory.absolute()
    while not existing.exists() and existing.parent != existing:
        existing = existing.parent
    if not existing.is_dir():
        return f"{existing} is a file"
    if not os.access(existing, os.W_OK | os.X_OK):
        return f"{existing} is not writable by this user (or is on a read-only file system)"
    return None


def _as_list(value) -> list:
    return list(value) if isinstance(value, (list, tuple)) else [value]


def _summarize_in_one_line(trainer: L.Trainer) -> None:
    """Replace Lightning's default model summary (a table) by ``OneLineModelSummary``."""
    for index, callback in enumerate(trainer.callbacks):
        if isinstance(callback, ModelSummary):
            trainer.callbacks[index] = OneLineModelSummary()


def _count_steps_in_progress_bar(trainer: L.Trainer) -> None:
    """Replace the bar Lightning adds by default (batches of an epoch) by ``StepProgress`` (the run's
    steps and its main metrics); a progress bar the user configured stays as it is."""
    default = trainer.progress_bar_callback
    if default is not None:
        trainer.callbacks[trainer.callbacks.index(default)] = StepProgress()


def _print_destinations(trainer: L.Trainer) -> None:
    """Tell the user where this run writes (logs and how to watch them, checkpoints, exports), and
    that it may stop before ``trainer.max_steps`` (a Rollout's ``validation.stop_at``)."""
    if trainer.global_rank != 0:
        return
    logger = trainer.logger
    # Trainer.log_dir's own choice, without its broadcast: a collective on rank 0 alone would wait
    # forever where the process group already exists
    log_dir = (
        logger.log_dir
        if isinstance(logger, (TensorBoardLogger, CSVLogger))
        else getattr(logger, "save_dir", None)
    )
    if log_dir is not None:
        print(f"lit-offpolicy: logs in {log_dir} (tensorboard --logdir {logger.save_dir})")
    for callback in trainer.callbacks:
        dirpath = getattr(callback, "dirpath", None)
        if isinstance(callback, HFExport):
            print(f"lit-offpolicy: {callback.start_note}")
        elif dirpath is not None:
            print(f"lit-offpolicy: {type(callback).__name__} writes to {dirpath}")
        validation = callback.worker.validation if isinstance(callback, Rollout) else None
        # evaluated at the start and every every_n_steps: the stop_after-th in a row comes at the earliest
        # at step (stop_after - 1) * every_n_steps
        if validation and validation.stop_at is not None and _may_stop_early(validation, trainer.max_steps):
            print(
                f"lit-offpolicy: stops early once val/accuracy >= {validation.stop_at} at "
                f"{validation.stop_after} evaluation(s) in a row (every {validation.every_n_steps} steps), "
                f"before trainer.max_steps={trainer.max_steps}; validation.stop_at: null runs them all"
            )


def _may_stop_early(validation, max_steps: int) -> bool:
    """Whether ``validation.stop_at`` can stop the run before ``max_steps`` (-1: no bound)."""
    return max_steps < 0 or (validation.stop_after - 1) * validation.every_n_steps < max_steps


def _reason(error: BaseException) -> str:
    """The message of ``error``'s root cause; where that is only one Union alternative's type mismatch
    (jsonargparse chains the first alternative's error: "Expected a <class 'str'>" for an engine given
    by class_path), the condensed report's own reason (the class's ValueError) instead."""
    root = str(_root_cause(error))
    if not root.startswith("Expected a <class"):
        return root
    condensed = condense(str(error))
    return root if condensed.startswith("expected ") else condensed


def _root_cause(error: BaseException) -> BaseException:
    """The innermost exception: jsonargparse wraps a constructor's ValueError in its own Union errors.
    An error raised ``from None`` (its context suppressed) is the innermost one."""
    while error.__cause__ is not None or (error.__context__ is not None and not error.__suppress_context__):
        error = error.__cause__ or error.__context__
    return error


class _OneLineArgumentParser(argparse.ArgumentParser):
    """An argparse parser whose errors (a bad ``--arch``, a missing directory) end the command with
    one ``lit-offpolicy: error: ...`` line and exit status 2, as the other subcommands' do; options
    are not abbreviated (``--over`` is not ``--overwrite``), as ``OneLineErrorParser``'s."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, allow_abbrev=False, **kwargs)

    def error(self, message: str) -> NoReturn:
        exit_with_error(f"{self.prog.removeprefix('lit-offpolicy ')}: {message}")


def _tiny_model_parser() -> argparse.ArgumentParser:
    parser = _OneLineArgumentParser(
        prog="lit-offpolicy create-tiny-model",
        description="Write a tiny random-initialized model and its tokenizer, offline: the built-in Llama "
        "(about 1M parameters, character tokenizer; the demo's model) or a Qwen2, Qwen3 or Mistral "
        "(about 0.5M parameters, byte-level BPE tokenizer and chat template).",
    )
    parser.add_argument("directory", help="where to write the model directory")
    parser.add_argument("--arch", choices=TINY_ARCHS, default="llama", help="model family (default: llama)")
    parser.add_argument("--seed", type=int, default=0, help="initialization seed (same seed, same weights)")
    parser.add_argument("--overwrite", action="store_true", help="replace the files of an existing directory")
    return parser


def _create_tiny_model(command: list[str]) -> None:
    """``create-tiny-model``; a path that is a file, or a non-empty directory without ``--overwrite``,
    ends with one line and exit status 2."""
    options = _tiny_model_parser().parse_args(command)
    directory = Path(options.directory)
    problem = None
    if directory.exists() and not directory.is_dir():
        problem = "is a file, not a directory"
    elif directory.is_dir() and any(directory.iterdir()) and not options.overwrite:
        problem = "exists and is not empty; pass --overwrite to replace its model"
    if problem is not None:
        exit_with_error(f"create-tiny-model: {directory} {problem}")
    print(f"wrote {create_tiny_model(directory, seed=options.seed, arch=options.arch)}")


def _prepare_data_parser() -> argparse.ArgumentParser:
    parser = _OneLineArgumentParser(
        prog="lit-offpolicy prepare-data",
        description="Turn a dataset file you already have into train/val parquet in verl's schema "
        "(read with data.answer_key: reward_model.ground_truth), offline.",
    )
    parser.add_argument(
        "dataset", choices=("gsm8k",), help="the file's layout: gsm8k (question, answer '... #### 42')"
    )
    parser.add_argument("--input", required=True, help="the .jsonl or .parquet file to convert")
    parser.add_argument("--output", required=True, help="directory for train.parquet and val.parquet")
    parser.add_argument(
        "--val-input", help="a file for val.parquet (default: hold out --val-size rows of --input)"
    )
    parser.add_argument(
        "--val-size", type=int, default=256, help="rows held out for validation (default 256)"
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the held-out draw")
    parser.add_argument("--overwrite", action="store_true", help="replace existing train/val parquet files")
    return parser


def _prepare_data(command: list[str]) -> None:
    """``prepare-data``: a bad file or option ends with one line and exit status 2."""
    options = _prepare_data_parser().parse_args(command)
    with _one_line_errors():
        paths = prepare_gsm8k(
            options.input,
            options.output,
            options.val_input,
            options.val_size,
            options.seed,
            options.overwrite,
        )
    for split, path in paths.items():
        print(f"wrote {path} ({split})")
    print(
        f"train with: --data.train_files '[{paths['train']}]' --data.val_files '[{paths['val']}]' "
        "--data.answer_key reward_model.ground_truth"
    )


def _working_directory_on_path() -> None:
    """Put the directory the command runs from first on ``sys.path``, as ``python -m lit_offpolicy``
    does: ``reward.fn: my_rewards:accuracy`` (or a ``class_path``) imports from it under either entry
    point. The console script puts only its own directory there."""
    here = os.getcwd()
    if "" not in sys.path and here not in sys.path:
        sys.path.insert(0, here)


def main(args: list[str] | None = None) -> None:
    command = sys.argv[1:] if args is None else args
    note_rank_zero()
    watch_rank_zero()
    _working_directory_on_path()
    stacks_on_sigusr2()
    stacks_on_crash()
    quiet_lightning()
    if command[:1] == ["create-tiny-model"]:
        _create_tiny_model(command[1:])
        return
    if command[:1] == ["prepare-data"]:
        _prepare_data(command[1:])
        return
    if broken := broken_config_file(command):
        exit_with_error(broken)
    set_parsing_settings(docstring_parse_attribute_docstrings=prints_descriptions(command))
    try:
        cli = OffPolicyCLI(
            L.LightningModule,
            PromptDataModule,
            subclass_mode_model=True,
            args=args,
            save_config_kwargs={"overwrite": True},
            parser_kwargs={
                "prog": "lit-offpolicy",
                "description": DESCRIPTION,
                "fit": {"description": FIT_HELP},
            },
            parser_class=OneLineErrorParser,
        )
        stopped_by = stopping_signal(cli.trainer)
        if stopped_by is not None:  # saved and stopped early: the status of a process ended by it
            raise SystemExit(128 + stopped_by)
    except (KeyboardInterrupt, SystemExit) as stop:
        if isinstance(stop, Preempted):  # a SystemExit that every rank raises together
            leave_after_rank_zero()
        # Lightning ends a fit interrupted by KeyboardInterrupt with status 1
        if (stopped := second_ctrl_c()) is None or isinstance(stop, SystemExit) and stop.code != 1:
            raise
        print(f"lit-offpolicy: {stopped}", file=sys.stderr)
        raise SystemExit(128 + signal.SIGINT) from None
    except RuntimeError as error:
        if (gone := rank_zero_reason(error)) is not None:  # Lightning's launcher: this rank's parent
            tell_rank_zero_gone(gone, then="; resume with --ckpt_path last")
            raise SystemExit(2) from None
        if (reason := peer_gone(error)) is None:
            raise
        # the rank whose process ended printed why (or was killed): a traceback here would bury it
        exit_with_error(
            f"trainer rank {distributed_rank()} lost another rank of this run ({reason}): that process "
            "ended first (killed, with no word of its own, or failed: then its output, above or in its "
            "log, says why); resume with --ckpt_path last"
        )
    except SIGTERMException as stop:
        # Lightning ends a SIGTERMed run with status 0, which a scheduler reads as a finished job;
        # 128 + the signal (SIGTERM, or SLURM's requeue signal) is the status of a process ended by it
        raise SystemExit(128 + getattr(stop, "signum", signal.SIGTERM)) from None
    finally:
        destroy_process_group()


if __name__ == "__main__":
    main()
