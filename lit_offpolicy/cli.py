"""The ``lit-offpolicy`` command: LightningCLI over the RL module (or the SFT warm-up) and prompt data.

lit-offpolicy fit --config configs/grpo.yaml
lit-offpolicy fit --config configs/sft_tiny.yaml
lit-offpolicy create-tiny-model outputs/tiny     # the built-in tiny Llama + tokenizer, offline
"""

from __future__ import annotations

import os
import signal
import sys

import lightning as L
from jsonargparse import Namespace, set_parsing_settings, strip_meta
from lightning.pytorch.cli import LightningCLI
from lightning.pytorch.utilities.exceptions import SIGTERMException

from lit_offpolicy.checkpointing import install_fault_tolerance
from lit_offpolicy.data import PromptDataModule
from lit_offpolicy.distributed import destroy_process_group
from lit_offpolicy.models import create_tiny_model

TRACEBACK_ENV = "LIT_OFFPOLICY_TRACEBACK"
TERMINATED_BY_SIGTERM = 128 + signal.SIGTERM
# the option groups (dataclasses) document each field in a docstring below it: show them in --help
set_parsing_settings(docstring_parse_attribute_docstrings=True)


class OffPolicyCLI(LightningCLI):
    """LightningCLI whose model is any LightningModule given by ``class_path`` (OffPolicyModule, SFTModule).

    A bad setting found while building the objects (a ValueError naming the option, a missing model
    directory) ends the command with that message and exit status 2, without a traceback; set
    ``LIT_OFFPOLICY_TRACEBACK=1`` to see it.

    Every trainer writes checkpoints atomically and saves ``last.ckpt`` when SIGTERM or SIGUSR1
    arrives (``lit_offpolicy.checkpointing.install_fault_tolerance``).
    """

    def instantiate_classes(self) -> None:
        try:
            self._check_data_options()
            super().instantiate_classes()
        except (ValueError, FileNotFoundError, OSError) as error:
            if os.environ.get(TRACEBACK_ENV):
                raise
            print(f"lit-offpolicy: error: {_root_cause(error)}", file=sys.stderr)
            raise SystemExit(2) from None

    def _check_data_options(self) -> None:
        """Build the data module once from its options before the model loads: LightningCLI builds
        the model first, and loading a large one takes minutes that a bad data option would waste."""
        config = self.config.get(str(self.subcommand), self.config)
        data = config.get("data")
        if isinstance(data, Namespace) and "class_path" not in data:
            self.datamodule_class(**strip_meta(data).as_dict())

    def instantiate_trainer(self, **kwargs) -> L.Trainer:
        trainer = super().instantiate_trainer(**kwargs)
        install_fault_tolerance(trainer)
        return trainer

    def before_fit(self) -> None:
        """Hand the model's tokenizer to the data module when it has none of its own."""
        datamodule = self.datamodule
        has_own = datamodule.tokenizer is not None or datamodule.tokenizer_path is not None
        if isinstance(datamodule, PromptDataModule) and not has_own:
            datamodule.set_tokenizer(self.model.tokenizer)


def _root_cause(error: BaseException) -> BaseException:
    """The innermost exception: jsonargparse wraps a constructor's ValueError in its own Union errors.
    An error raised ``from None`` (its context suppressed) is the innermost one."""
    while error.__cause__ is not None or (error.__context__ is not None and not error.__suppress_context__):
        error = error.__cause__ or error.__context__
    return error


def main(args: list[str] | None = None) -> None:
    command = sys.argv[1:] if args is None else args
    if command[:1] == ["create-tiny-model"]:
        if len(command) != 2:
            raise SystemExit("usage: lit-offpolicy create-tiny-model DIRECTORY")
        print(f"wrote {create_tiny_model(command[1])}")
        return
    try:
        OffPolicyCLI(
            L.LightningModule,
            PromptDataModule,
            subclass_mode_model=True,
            args=args,
            save_config_kwargs={"overwrite": True},
        )
    except SIGTERMException:
        # Lightning ends a SIGTERMed run (after PreemptionCheckpoint saved it) with status 0, which a
        # scheduler reads as a finished job; 128 + SIGTERM is the status of a terminated process
        raise SystemExit(TERMINATED_BY_SIGTERM) from None
    finally:
        destroy_process_group()


if __name__ == "__main__":
    main()
