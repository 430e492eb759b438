"""What a run reads and where it saves, checked from the parsed config before anything is built.

- Every model directory the config names, wherever it sits (the actor, a critic, a reference, a
  distillation teacher, a judge or reward model, a tokenizer), is a local model directory: a missing
  one is one line naming its option, and nothing is ever looked up on the Hugging Face Hub.
- A frozen model (a teacher, a reference, a judge or reward model) is not read from a directory the
  same run writes (an ``HFExport`` or a checkpoint ``dirpath``): the next run would read this run's
  output instead (a teacher would be the last student).
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import yaml
from jsonargparse import Namespace, strip_meta

from lit_offpolicy.models import require_model_dir

MODEL_DIRECTORY_KEYS = ("model_path", "critic_path", "reference_path", "teacher_path", "tokenizer_path")
"""The options that name a model (or tokenizer) directory, wherever they sit in a config."""
TRAINED = "model.init_args.model_path"
"""The one ``model_path`` a run may also write: an export over the actor's own start is the user's choice."""


def model_directories(config: Namespace) -> Iterator[tuple[str, str]]:
    """(option, directory) for each model directory the config names. The module's and the data's
    options are named as written on the command line (``model.init_args.distill.teacher_path``); one
    of an object given by ``class_path`` elsewhere by its class (``JudgeReward.model_path``)."""
    plain = strip_meta(config).as_dict()
    for root in ("model", "data", "trainer"):
        yield from _walk(plain.get(root), root, root_entry=True)


def _walk(value: Any, label: str, root_entry: bool = False) -> Iterator[tuple[str, str]]:
    """The (option, directory) pairs under ``value``, whose option is ``label``; ``root_entry``: the
    top-level entry (``model``), whose own ``class_path`` does not rename its options."""
    if isinstance(value, list):
        for item in value:
            yield from _walk(item, label)
    elif isinstance(value, dict):
        if "class_path" in value and not root_entry:
            name = str(value["class_path"]).replace(":", ".").rsplit(".", 1)[-1]
            yield from _walk(value.get("init_args"), name)
            return
        for key, item in value.items():
            option = f"{label}.{key}"
            if key in MODEL_DIRECTORY_KEYS and isinstance(item, (str, Path)):
                yield option, str(item)
            else:
                yield from _walk(item, option)


def check_model_directories(config: Namespace) -> None:
    """Each model directory the config names exists and holds a ``config.json`` (``require_model_dir``),
    or a ``FileNotFoundError`` names its option: before any model loads, and never a Hub download."""
    for option, directory in model_directories(config):
        try:
            require_model_dir(directory, option)
        except FileNotFoundError as missing:
            if maker := _config_that_exports(directory):
                made_by = f"{directory} is what `lit-offpolicy fit --config {maker}` exports: run that first"
                raise FileNotFoundError(f"{missing}; {made_by}") from None
            raise


def _config_that_exports(directory: str) -> str | None:
    """The shipped config (under ./configs) whose ``HFExport`` writes ``directory``, as the SFT warm-up
    writes the model that the RL configs read; None if none does."""
    wanted = Path(directory).resolve()
    for path in sorted(Path("configs").glob("**/*.yaml")):
        try:
            text = path.read_text()
            if "HFExport" in text and _exports_to(yaml.safe_load(text), wanted):
                return str(path)
        except (OSError, yaml.YAMLError):
            continue
    return None


def _exports_to(config: Any, wanted: Path) -> bool:
    """Whether one of the config's ``trainer.callbacks`` is an ``HFExport`` to ``wanted``."""
    trainer = config.get("trainer") if isinstance(config, dict) else None
    for callback in (trainer or {}).get("callbacks") or []:
        if isinstance(callback, dict) and str(callback.get("class_path")).endswith("HFExport"):
            dirpath = (callback.get("init_args") or {}).get("dirpath")
            if isinstance(dirpath, str) and Path(dirpath).resolve() == wanted:
                return True
    return False


def check_frozen_models_are_not_written(config: Namespace, written: Iterable[tuple[str, str]]) -> None:
    """Refuse a frozen model (a teacher, a reference, a judge) read from a directory that the run writes
    into, itself or below it (``written``: (option, directory), such as ``HFExport.dirpath``). A written
    path that is a link (``HFExport``'s latest-model link) is the link, not the model it names now."""
    written = list(written)
    for option, directory in model_directories(config):
        if not _frozen(option):
            continue
        read = (_as_named(directory), Path(directory).resolve())
        for writer, target in written:
            if any(_as_named(target).is_relative_to(name) for name in read):
                raise ValueError(
                    f"{option}={directory} is written by this same run ({writer}={target}): the model "
                    f"would be replaced by this run's output (a teacher by its student) for every later "
                    f"run; give {writer} another directory, or read {option} from a copy"
                )


def _as_named(path: str) -> Path:
    """``path`` made absolute with the links of its parents followed, its own name kept (a link stays)."""
    return Path(os.path.realpath(Path(path).absolute().parent)) / Path(path).name


def _frozen(option: str) -> bool:
    """Whether the model ``option`` names stays as it is while the run trains: a teacher, a reference,
    or the ``model_path`` of anything but the module (a judge, a reward model); not the actor, a critic
    or a tokenizer."""
    key = option.rsplit(".", 1)[-1]
    return key in ("teacher_path", "reference_path") or (key == "model_path" and option != TRAINED)
