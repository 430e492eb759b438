"""Shared test harnesses: the ``helpers`` package (tests/helpers/), importable wherever tests/ is on
``sys.path``.

- In the pytest session: ``pythonpath = [".", "tests"]`` (pyproject.toml, ``[tool.pytest.ini_options]``).
- In a process a test starts: :func:`subprocess_env` puts the repository and tests/ on ``PYTHONPATH``.
- In a YAML config (in-process, in a subprocess, in a reward worker or on a SLURM node):
  ``class_path: helpers.HashReward``.

This module stays light (no torch, no Lightning): ``tests/conftest.py`` imports it before any test
runs, so that :data:`_ENVIRONMENT_AT_START` is the session's environment as it started.
"""

from __future__ import annotations

import os
import zlib
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
"""tests/"""
REPO = TESTS.parent
"""The repository's root."""
FIXTURES = TESTS / "fixtures"
"""Data files of the tests (tests/fixtures/)."""
CONFIGS = REPO / "configs"
"""The shipped configs."""
PYTHONPATH = os.pathsep.join([str(REPO), str(TESTS)])
"""What a process started by a test needs on its path: ``benchmarks``, ``helpers`` (and ``lit_offpolicy``,
installed in the venv anyway)."""

_ENVIRONMENT_AT_START = dict(os.environ)


def subprocess_env(**extra: str) -> dict[str, str]:
    """The environment for a process a test starts: the session's environment as it was before any
    test ran (an in-process vLLM engine sets ``LD_PRELOAD`` to torch's libgomp, ``LOCAL_WORLD_SIZE``
    and more, which made later 2-process FSDP2 fits hang or abort at exit), without SLURM's
    variables or ``LOCAL_RANK``, with one OpenMP thread, unbuffered output and :data:`PYTHONPATH` (so
    that ``helpers.HashReward`` resolves there too); then ``extra``."""
    env = {k: v for k, v in _ENVIRONMENT_AT_START.items() if not k.startswith(("SLURM_", "LOCAL_RANK"))}
    inherited = env.get("PYTHONPATH")
    env.update(
        OMP_NUM_THREADS="1",
        PYTHONUNBUFFERED="1",
        PYTHONPATH=os.pathsep.join([PYTHONPATH, inherited]) if inherited else PYTHONPATH,
    )
    env.update(extra)
    return env


class HashReward:
    """A RewardFn whose scores (0, 0.25, ..., 1) are a hash of the response: varied and deterministic.

    An untrained tiny model never answers an addition right, so the exact-match reward would be 0
    everywhere, every advantage 0 and no gradient would flow.
    """

    def __call__(self, completions: list[str], **columns) -> list[float]:
        return [zlib.crc32(c.encode()) % 5 / 4 for c in completions]
