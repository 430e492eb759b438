"""Benchmarks: ours against a baseline measured in the same run (docs/benchmarks.md), one folder per kind
of baseline; ``run.py`` runs them, ``common.py`` holds the timing and helpers they share."""

import os
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
"""The repository's root: configs/, tests/fixtures/, and what a child process needs on ``PYTHONPATH``."""


def repo_env(**extra: str) -> dict[str, str]:
    """This process's environment with the repository on ``PYTHONPATH`` (a child imports ``benchmarks``),
    and ``extra``."""
    return {**os.environ, "PYTHONPATH": str(REPO), **extra}
