"""Argument checks that fail with a ``ValueError`` naming the option, the value and what is allowed."""

from __future__ import annotations

import math
from collections.abc import Iterable

from torch import Tensor


def check_choice(option: str, value, choices: Iterable):
    """Return ``value`` if it is one of ``choices``; otherwise raise naming all of them."""
    choices = tuple(choices)
    if value not in choices:
        allowed = ", ".join(repr(c) for c in choices)
        raise ValueError(f"{option}={value!r} is not supported; allowed values: {allowed}")
    return value


def check_range(
    option: str,
    value: float,
    *,
    low: float | None = None,
    high: float | None = None,
    low_inclusive: bool = True,
    high_inclusive: bool = True,
) -> float:
    """Return ``value`` if it is a finite number within [low, high] (or the open ends asked for)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{option}={value!r} must be a finite number")
    too_low = low is not None and (value < low if low_inclusive else value <= low)
    too_high = high is not None and (value > high if high_inclusive else value >= high)
    if too_low or too_high:
        left = "[" if low_inclusive else "("
        right = "]" if high_inclusive else ")"
        bounds = f"{left}{'-inf' if low is None else low}, {'inf' if high is None else high}{right}"
        raise ValueError(f"{option}={value!r} is out of range; allowed values: {bounds}")
    return value


def check_same_shape(**tensors: Tensor | None) -> None:
    """Raise if the given (non-None) tensors do not all have the same shape."""
    shapes = {name: tuple(t.shape) for name, t in tensors.items() if t is not None}
    if len(set(shapes.values())) > 1:
        listed = ", ".join(f"{name}{list(shape)}" for name, shape in shapes.items())
        raise ValueError(f"tensor shapes must match: {listed}")
