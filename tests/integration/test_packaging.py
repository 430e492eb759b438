"""The installed package: every sub-package is listed in pyproject.toml, the entry points answer."""

import subprocess
import sys
import tomllib

from helpers import REPO


def test_every_subpackage_is_installed():
    listed = set(tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    inits = (REPO / "lit_offpolicy").rglob("__init__.py")
    found = {".".join(path.parent.relative_to(REPO).parts) for path in inits}
    assert found | {"lit_offpolicy.callbacks"} == listed


def test_help_answers():
    """``python -m lit_offpolicy``; the console script's ``fit --help``: tests/cli/test_command_line.py."""
    out = subprocess.run(
        [sys.executable, "-m", "lit_offpolicy", "--help"],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert "usage: " in out.stdout and "fit" in out.stdout
