"""The layer order holds: import-linter's contracts (pyproject.toml, ``[tool.importlinter]``) are kept.

callbacks/ installs as ``lit_offpolicy.callbacks``; import-linter reads the package's folder, so the
check runs on a copy of the tree with callbacks/ at that place (``make lint-imports`` does the same).
"""

import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def installed_layout(directory: Path) -> Path:
    """A copy of lit_offpolicy/ with callbacks/ inside it, as the installed package has it."""
    shutil.copytree(REPO / "lit_offpolicy", directory / "lit_offpolicy")
    shutil.copytree(REPO / "callbacks", directory / "lit_offpolicy" / "callbacks")
    return directory


def lint_imports(directory: Path) -> subprocess.CompletedProcess:
    lint = Path(sys.executable).with_name("lint-imports")
    return subprocess.run(
        [str(lint), "--config", str(REPO / "pyproject.toml"), "--no-cache"],
        cwd=directory,
        env={"PYTHONPATH": str(directory), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_no_import_climbs_a_layer(tmp_path):
    result = lint_imports(installed_layout(tmp_path))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 broken" in result.stdout


def test_a_climbing_import_breaks_the_contract(tmp_path):
    """The check can fail: core importing the callbacks is reported, with the line."""
    tree = installed_layout(tmp_path)
    with (tree / "lit_offpolicy" / "core" / "checks.py").open("a") as file:
        file.write("\nfrom lit_offpolicy.callbacks import Rollout  # noqa\n")
    result = lint_imports(tree)
    assert result.returncode != 0
    assert "lit_offpolicy.core.checks -> lit_offpolicy.callbacks" in result.stdout


DOCSTRING_LIMIT = 25  # lines: longer reasoning belongs in a comment beside the code or in docs/


def long_docstrings(root: Path) -> list[str]:
    """Every module, class or function docstring under ``root`` that is over DOCSTRING_LIMIT lines."""
    import ast

    found = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            first = node.body[0] if node.body else None
            if not (isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant)):
                continue
            lines = first.end_lineno - first.lineno + 1
            if isinstance(first.value.value, str) and lines > DOCSTRING_LIMIT:
                name = getattr(node, "name", "module")
                found.append(f"{path.relative_to(root)}:{first.lineno} {name}: {lines} lines")
    return found


def test_no_docstring_is_over_25_lines():
    assert long_docstrings(REPO / "lit_offpolicy") + long_docstrings(REPO / "callbacks") == []


def test_a_long_docstring_is_found(tmp_path):
    (tmp_path / "long.py").write_text('def f():\n    """' + "line\n" * 26 + '"""\n')
    assert len(long_docstrings(tmp_path)) == 1
