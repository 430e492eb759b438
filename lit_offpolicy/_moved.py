"""Import paths from before the packages-by-role layout, kept working for users' code and configs.

``import lit_offpolicy.checkpointing`` (or a config's ``class_path: lit_offpolicy.options...``) gets
the module at its new place, with a ``DeprecationWarning`` naming that place.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import warnings

MOVED = {
    "checkpointing": "training.checkpointing",
    "checks": "core.checks",
    "compiling": "training.compiling",
    "console": "cli.console",
    "demo": "examples.demo",
    "evaluation": "rollout.evaluation",
    "experience": "core.experience",
    "files": "core.files",
    "forward": "training.forward",
    "lora": "models.lora",
    "masked": "core.masked",
    "memory": "core.memory",
    "micro_batches": "training.micro_batches",
    "numerics": "training.numerics",
    "options": "training.options",
    "packed_attention": "training.packed_attention",
    "packing": "training.packing",
    "parser_errors": "cli.parser_errors",
    "records": "core.records",
    "registry": "core.registry",
    "step_metrics": "training.step_metrics",
    "tensorboard": "core.tensorboard",
    "tiny_models": "models.tiny",
    "tool_demo": "examples.tool_demo",
    "weight_sync": "rollout.weight_sync",
}


class _MovedModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds ``lit_offpolicy.<old>`` and loads it as ``lit_offpolicy.<new>`` (the same module object)."""

    def find_spec(self, fullname, path=None, target=None):
        package, _, name = fullname.rpartition(".")
        if package != "lit_offpolicy" or name not in MOVED:
            return None
        return importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec):
        new = f"lit_offpolicy.{MOVED[spec.name.rpartition('.')[2]]}"
        warnings.warn(f"{spec.name} moved to {new}", DeprecationWarning, stacklevel=2)
        return importlib.import_module(new)

    def exec_module(self, module):
        # the module is already executed; the import system set its __spec__ to the old name: restore it
        module.__spec__ = importlib.util.spec_from_file_location(module.__name__, module.__file__)


def install() -> None:
    """Put the finder on ``sys.meta_path`` once."""
    if not any(isinstance(finder, _MovedModules) for finder in sys.meta_path):
        sys.meta_path.append(_MovedModules())
