"""One-line command-line errors: jsonargparse's nested reports condensed.

Each names the option, the value and the reason, with the closest valid name where one is near.

jsonargparse reports an error inside a ``class_path`` object as a tree: every Union alternative that
failed (including "Expected a <class 'NoneType'>"), the given value again, and the usage of every
option first (60 to 80 lines for ``lr: abc``). Only one branch of that tree is the user's mistake:
the deepest reason under the chain of ``Parser key`` lines.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib
import inspect
import os
import re
import sys
import typing
from pathlib import Path
from typing import NoReturn

import yaml
from jsonargparse import Namespace
from lightning.pytorch.cli import LightningArgumentParser

from lit_offpolicy.rewards import RewardConfig

TRACEBACK_ENV = "LIT_OFFPOLICY_TRACEBACK"
"""Set (to anything) to get jsonargparse's full report, and tracebacks, instead of one line."""

_KEY = re.compile(r'^Parser key "([^"]+)":$')
_CLASS_PATH = re.compile(r"^(?:- )?Problem with given class_path '([^']+)':$")
_NOISE = re.compile(
    r"^(Does not validate against any of the Union subtypes|Subtypes: |Errors:|Given value|"
    r"- Expected a <class '[^']+'>$)"
)
_TYPE_MISMATCH = re.compile(r"^Expected a <class '[^']+'>")
_NO_ATTRIBUTE = re.compile(r"module '([\w.]+)' has no attribute '(\w+)'")
_UNRECOGNIZED = re.compile(r"unrecognized arguments: (--[\w.]+)")
_NOT_A_PATH = re.compile(r"Expected a dot import path string: (\w+)$")
PLUGIN_MODULES = {
    "policy_loss": ("lit_offpolicy.losses",),
    "advantage": ("lit_offpolicy.advantages",),
    "fn": ("lit_offpolicy.rewards",),
    "engine": ("lit_offpolicy.rollout",),
    "logger": ("lightning.pytorch.loggers",),
    "callbacks": ("lit_offpolicy.callbacks", "lightning.pytorch.callbacks"),
}
"""Where a short class name (``class_path: TOPR``) that names no class is looked for a near one, by
the option's last key; any other option: all of them."""
_REWARD_OPTION = re.compile(r"Group 'reward' does not accept option '(\w+)'")
_GROUP_OPTION = re.compile(r"Group '(\w+)' does not accept option '(\w+)'")
_INIT_OPTION = re.compile(r"Option '(\w+)' is not accepted\. Got value: Namespace\(class_path='([\w.]+)'")


def condense(message: str, known_options: list[str] | None = None) -> str:
    """The option path (``model.init_args.optim.lr``), the class_path where that is what failed, and
    the deepest reason of a jsonargparse error report; a "did you mean" where one name is close."""
    keys: list[str] = []
    class_path = None  # the class_path line last seen, until a key below it shows it loaded
    reason, reason_depth = None, -1
    for raw in message.splitlines():
        line = raw.strip()
        depth = len(raw) - len(raw.lstrip())
        if key := _KEY.match(line):
            keys += ["init_args", key.group(1)] if class_path else [key.group(1)]
            class_path = None
        elif path := _CLASS_PATH.match(line):
            class_path = path.group(1)
        elif (
            line
            and not _NOISE.match(line)
            and (depth > reason_depth or _weaker(reason, line, depth, reason_depth))
        ):
            reason, reason_depth = line.removeprefix("- "), depth
    reason = reason or f"invalid value ({TRACEBACK_ENV}=1 shows the parser's full report)"
    reason = re.sub(r"Expected a <class '([\w.]+)'>\. Got value: ", r"expected \1, got ", reason)
    reason = re.sub(r'^Parser key "([^"]+)": ', r"\1: ", re.sub(r"<class '([\w.]+)'>", r"\1", reason))
    if class_path and reason.startswith("unrecognized arguments"):
        keys.append("init_args")  # the class loaded; an argument under it is unknown
        class_path = None
    parts = [".".join(keys) + ":" if keys else None, f"class_path {class_path!r}:" if class_path else None]
    text = " ".join([part for part in parts if part] + [reason])
    unknown_init_option = _INIT_OPTION.search(reason)
    suggest = not keys or class_path or _NOT_A_PATH.search(reason) or unknown_init_option
    suggestion = _closest_name(reason, known_options or [], keys, class_path) if suggest else None
    if unknown_init_option:  # the class, not the type's name and the whole value again
        option, named_class = unknown_init_option.groups()
        text = text.replace(reason, f"{named_class} does not accept option {option!r}")
    if wrong := _REWARD_OPTION.search(reason):
        text += _reward_option_hint(wrong.group(1))
    return f"{text} (did you mean {suggestion!r}?)" if suggestion else text


def _reward_option_hint(key: str) -> str:
    """Where an option given to the reward (``RewardConfig``) belongs: a near field of its own, or the
    reward function's ``init_args`` (``isolation`` is ``CodeExecutionReward``'s, not the reward's)."""
    fields = [field.name for field in dataclasses.fields(RewardConfig)]
    close = difflib.get_close_matches(key, fields, n=1)
    if close:
        return f"; did you mean reward.{close[0]}?"
    return (
        f"; the reward's own options are {', '.join(fields)}; an option of the reward function goes in "
        f"its init_args: reward.fn.init_args.{key} (on the command line: --rollout.reward.fn.init_args.{key} "
        "VALUE, with reward.fn given by class_path)"
    )


def _weaker(reason: str | None, line: str, depth: int, reason_depth: int) -> bool:
    """At the same depth, a Union alternative's own message ("engine.dtype='float64' is not supported")
    says more than another alternative's type mismatch ("Expected a <class 'str'>. Got value: ...")."""
    return (
        depth == reason_depth
        and reason is not None
        and _TYPE_MISMATCH.match(reason) is not None
        and (_TYPE_MISMATCH.match(line.removeprefix("- ")) is None)
    )


def _closest_name(
    reason: str, known_options: list[str], keys: list[str], class_path: str | None = None
) -> str | None:
    """The valid name nearest to the one the reason says is wrong, where there is a close one."""
    if unknown := _INIT_OPTION.search(reason):  # reward.fn: {class_path: ..., init_args: {timeout: 5}}
        return _closest(unknown.group(1), _options_of(unknown.group(2)))
    if (grouped := _GROUP_OPTION.search(reason)) and class_path and grouped.group(1) != "reward":
        group, name = grouped.groups()  # class_path Rollout: Group 'sampling' does not accept 'temp'
        return _closest(name, _options_of(class_path, group))
    if missing := _NO_ATTRIBUTE.search(reason):
        module, name = missing.groups()
        try:
            candidates = [n for n in dir(importlib.import_module(module)) if not n.startswith("_")]
        except ImportError:
            return None
        close = difflib.get_close_matches(name, candidates, n=1)
        return f"{module}.{close[0]}" if close else None
    if short := _NOT_A_PATH.search(reason):
        modules = PLUGIN_MODULES.get(keys[-1] if keys else "") or sum(PLUGIN_MODULES.values(), ())
        return _closest_class(short.group(1), modules)
    if unknown := _UNRECOGNIZED.search(reason):
        close = difflib.get_close_matches(unknown.group(1), known_options, n=1)
        return close[0] if close else None
    return None


def _options_of(class_path: str, group: str | None = None) -> list[str]:
    """The ``__init__`` options of the class at ``class_path``, or the fields of its dataclass-typed
    option ``group`` (Rollout's ``sampling``); none where it does not import."""
    module_name, _, name = class_path.rpartition(".")
    try:
        target = getattr(importlib.import_module(module_name), name)
        if group is not None:
            target = typing.get_type_hints(target.__init__).get(group)
            return (
                [field.name for field in dataclasses.fields(target)]
                if dataclasses.is_dataclass(target)
                else []
            )
        return [option for option in inspect.signature(target).parameters if option not in ("args", "kwargs")]
    except (ImportError, AttributeError, TypeError, ValueError, NameError):
        return []


def _closest(name: str, candidates: list[str]) -> str | None:
    """The one candidate that ``name`` begins (``temp``: ``temperature``), else the nearest close one."""
    extended = [candidate for candidate in candidates if candidate.startswith(name)]
    close = extended if len(extended) == 1 else difflib.get_close_matches(name, candidates, n=1)
    return close[0] if close else None


def _closest_class(name: str, modules: tuple[str, ...]) -> str | None:
    """The import path of the public class in ``modules`` whose name is nearest to ``name``, ignoring
    case (``topr`` and ``TOPRLoss`` find ``lit_offpolicy.losses.TOPR``)."""
    paths: dict[str, str] = {}
    for module_name in modules:
        module = importlib.import_module(module_name)
        for attribute in dir(module):
            if attribute[:1].isupper() and isinstance(getattr(module, attribute), type):
                paths.setdefault(attribute.lower(), f"{module_name}.{attribute}")
    close = difflib.get_close_matches(name.lower(), list(paths), n=1)
    return paths[close[0]] if close else None


class OneLineErrorParser(LightningArgumentParser):
    """LightningCLI's parser, ending a bad command line with ``lit-offpolicy: error: ...`` on one
    line (exit status 2) instead of the usage and jsonargparse's report.

    Options are not abbreviated: argparse took ``--trainer.max_step 2`` for ``--trainer.max_steps``, so
    a typo that begins a real name was silently accepted; it is now an unrecognized argument. The
    parsers jsonargparse makes from this one (``fit``'s, a class_path's ``init_args``) do not either."""

    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message: str, ex: Exception | None = None) -> NoReturn:
        if not self.exit_on_error or os.environ.get(TRACEBACK_ENV):
            super().error(message, ex)
        known = [name for name in self._option_string_actions if name.startswith("--")]
        command = self.prog.replace(" [options]", "")
        sys.stderr.write(f"lit-offpolicy: error: {condense(message, known)} (options: {command} --help)\n")
        self.exit(2)

    def _check_value_key(self, action, value, key, cfg, append=False):
        """A list a later config file gives (``trainer.callbacks: [...]``) replaces the list an earlier
        one gave, whatever their lengths; ``key+: [...]`` appends to it. jsonargparse merged two lists
        of equal length item by item, so a config's own Rollout kept the base's temperature and stop rule."""
        if isinstance(value, list) and not append and isinstance(cfg, Namespace) and key in cfg:
            cfg = cfg.clone()
            del cfg[key]
        return super()._check_value_key(action, value, key, cfg, append=append)


CONFIG_OPTIONS = ("-c", "--config", "--trainer", "--data", "--model")
"""Options that take a YAML file (LightningCLI also reads a file for a group: ``--trainer ddp.yaml``)."""


def broken_config_file(command: list[str]) -> str | None:
    """``file: line L, column C: problem`` for the first YAML file of the command line that does not
    parse; jsonargparse's own message names no file ("in <unicode string>")."""
    for index, argument in enumerate(command):
        option, _, value = argument.partition("=")
        if not value and index + 1 < len(command):
            value = command[index + 1]
        if option not in CONFIG_OPTIONS or not Path(value).is_file():
            continue
        try:
            yaml.safe_load(Path(value).read_text())
        except yaml.MarkedYAMLError as error:
            mark = error.problem_mark
            return f"{value}: line {mark.line + 1}, column {mark.column + 1}: {error.problem}"
        except yaml.YAMLError as error:
            return f"{value}: {error}"
    return None
