"""One way to name pluggable parts (policy losses, advantage estimators, rollout engines, rewards).

A :class:`Registry` maps short names to classes (or functions) that register themselves with a
decorator; a config value is then resolved the same way everywhere (:meth:`Registry.resolve`):

- an object, as given (what LightningCLI builds from ``class_path`` / ``init_args``);
- a short name, e.g. ``"topr"``, built with its defaults;
- an import path ``"pkg.module:name"`` to a class (built with its defaults) or a function (as is);
- a mapping ``{"class_path": "pkg.module.Name", "init_args": {...}}``, the form a checkpoint keeps
  (:func:`component_config`).
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
from collections.abc import Callable, Iterator, Mapping
from typing import Any, Generic, TypeVar

T = TypeVar("T")


class Registry(Mapping[str, T], Generic[T]):
    """Short names of one kind of part; ``option`` is the config key that errors name.

    ``base`` is the type every resolved object must be an instance of (None: any callable).
    """

    def __init__(self, option: str, base: type | None = None) -> None:
        self.option = option
        self.base = base
        self._entries: dict[str, T] = {}

    def register(self, name: str) -> Callable[[T], T]:
        """Decorator: ``@REGISTRY.register("name")`` above a class or function."""

        def add(entry: T) -> T:
            if name in self._entries and self._entries[name] is not entry:
                raise ValueError(
                    f"{self.option} name {name!r} is already registered to {self._entries[name]!r}"
                )
            self._entries[name] = entry
            return entry

        return add

    def __getitem__(self, name: str) -> T:
        return self._entries[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, name: str, option: str | None = None) -> T:  # type: ignore[override]
        """The entry registered as ``name``; a ValueError naming the option and every key otherwise."""
        if name not in self._entries:
            allowed = ", ".join(repr(key) for key in self._entries)
            raise ValueError(
                f"{option or self.option}={name!r} is not supported; allowed values: {allowed}, "
                "or an import path 'pkg.module:name'"
            )
        return self._entries[name]

    def resolve(self, value: Any, option: str | None = None, **kwargs: Any) -> Any:
        """An object from a config value (see the module docstring); classes are built with ``kwargs``."""
        option = option or self.option
        if isinstance(value, str):
            entry = import_object(value, option) if ":" in value else self.get(value, option)
            built = entry(**kwargs) if inspect.isclass(entry) else entry
        elif isinstance(value, Mapping) and "class_path" in value:
            cls = import_object(value["class_path"], option)
            built = cls(**{**value.get("init_args", {}), **kwargs})
        else:
            built = value
        return self._checked(built, value, option)

    def _checked(self, built: Any, value: Any, option: str) -> Any:
        ok = isinstance(built, self.base) if self.base is not None else callable(built)
        if not ok:
            wanted = self.base.__name__ if self.base is not None else "a callable"
            raise ValueError(f"{option}={value!r} gives a {type(built).__name__}, not {wanted}")
        return built


def import_object(path: str, option: str) -> Any:
    """The object at ``"pkg.module:name"`` (``"pkg.module.Name"`` also, for ``class_path`` values)."""
    module_name, _, name = path.partition(":") if ":" in path else path.rpartition(".")
    try:
        target = importlib.import_module(module_name)
        for part in name.split("."):
            target = getattr(target, part)
    except (ImportError, AttributeError, ValueError) as error:
        # from None: the CLI prints the innermost error, and this one names the cause already
        raise ValueError(f"{option}={path!r} cannot be imported ({error}); write 'pkg.module:name'") from None
    return target


def component_config(obj: Any) -> dict[str, Any]:
    """``{"class_path", "init_args"}`` that rebuild ``obj`` through :meth:`Registry.resolve`.

    A dataclass gives its fields; another class the attributes named like its constructor's
    parameters (every built-in loss and estimator keeps its arguments so).
    """
    cls = type(obj)
    if dataclasses.is_dataclass(obj):
        init_args = {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj) if f.init}
    else:
        names = [
            name
            for name, p in inspect.signature(cls).parameters.items()
            if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
        ]
        missing = [name for name in names if not hasattr(obj, name)]
        if missing:
            raise TypeError(
                f"{cls.__name__} does not keep its arguments {missing} as attributes of the same names, "
                "so a checkpoint cannot record how to rebuild it"
            )
        init_args = {name: getattr(obj, name) for name in names}
    return {"class_path": f"{cls.__module__}.{cls.__qualname__}", "init_args": init_args}
