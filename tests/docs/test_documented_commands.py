"""The documented-commands runner: which lines are commands, their CI marks, and a run of a small page."""

import os
import shlex
import time

import psutil
import pytest

from lit_offpolicy.rollout.server.process import free_port
from tests.documented_commands import (
    REPO,
    Command,
    MarkError,
    _copy_tree,
    documented_pages,
    extract,
    fresh_copy,
    main,
    run_command,
)

PAGE = """# A page

```bash
lit-offpolicy create-tiny-model outputs/tiny     # a comment
# a comment line, then a program that is not ours
tensorboard --logdir outputs/logs
lit-offpolicy fit --config configs/grpo.yaml \\
    --trainer.max_steps 500     # the config's steps
python -m lit_offpolicy.examples.demo --seed 1
```
<!-- ci:
run
run --trainer.max_steps 2
skip needs a GPU
-->

```yaml
# lit-offpolicy fit --config inside YAML is not a command
model: {}
```

```text
$ lit-offpolicy fit --config output.yaml
```
"""


def test_commands_their_lines_and_marks_are_extracted_in_order():
    tiny, fit, demo = extract(PAGE, "page.md")
    assert (tiny.line, tiny.action, tiny.argv()) == (
        4,
        "run",
        ["lit-offpolicy", "create-tiny-model", "outputs/tiny"],
    )
    assert fit.line == 7
    assert fit.argv()[-4:] == ["--trainer.max_steps", "500", "--trainer.max_steps", "2"]
    assert (demo.action, demo.reason) == ("skip", "needs a GPU")


def test_a_one_line_mark_and_an_expected_failure():
    page = "```sh\nmake demo\npython -m json.tool missing.json\n```\n\n<!-- ci: run\nfail 2 -->\n"
    demo, failing = extract(page, "p.md")
    assert (demo.text, demo.action) == ("make demo", "run")
    assert (failing.action, failing.expected_code) == ("fail", 2)


def test_an_export_line_holds_for_the_page_s_later_commands_and_is_not_itself_marked():
    page = (
        "```bash\nmake demo\nexport OMP_NUM_THREADS=2   # few\nmake test\n```\n<!-- ci: run\nrun -->\n"
        "```bash\nmake demo\n```\n<!-- ci: run -->\n"
    )
    before, after, next_block = extract(page, "p.md")
    assert before.script() == "make demo"
    assert after.script() == "export OMP_NUM_THREADS=2; make test"
    assert next_block.script() == "export OMP_NUM_THREADS=2; make demo"


def test_python_without_dash_m_and_non_shell_blocks_are_not_commands():
    assert extract("```bash\npython script.py\n```\n\n```python\nmake = 1\n```\n", "p.md") == []


@pytest.mark.parametrize(
    "page, message",
    [
        ("```bash\nlit-offpolicy fit\n```\nText.\n", "p.md:2: a block of 1 command(s) without"),
        ("```bash\nlit-offpolicy fit\nmake demo\n```\n<!-- ci: run -->\n", "2 command(s) in the block but 1"),
        ("```bash\nlit-offpolicy fit\n```\n<!-- ci: run --seed 3 -->\n", "may only append step counts"),
        ("```bash\nlit-offpolicy fit\n```\n<!-- ci: run --trainer.max_steps -->\n", "may only append step"),
        ("```bash\nlit-offpolicy fit\n```\n<!-- ci: skip -->\n", "`skip` needs a reason"),
        ("```bash\nlit-offpolicy fit\n```\n<!-- ci: fail -->\n", "`fail` needs the non-zero exit code"),
        ("```bash\nlit-offpolicy fit\n```\n<!-- ci: fail 0 -->\n", "`fail` needs the non-zero exit code"),
        ("```bash\nlit-offpolicy fit\n```\n<!-- ci: runs -->\n", "unknown mark 'runs'"),
        ("```bash\nlit-offpolicy fit\n```\n<!-- ci: run\n", "without its closing `-->`"),
    ],
)
def test_a_block_whose_marks_do_not_fit_is_refused_with_its_line(page, message):
    with pytest.raises(MarkError, match=message.replace("(", r"\(").replace(")", r"\)")):
        extract(page, "p.md")


def test_every_command_in_the_readme_and_docs_is_marked():
    commands = [command for page in documented_pages() for command in extract(page.read_text(), page.name)]
    assert len(commands) >= 10, "the README and docs/ hold at least the quick start's commands"
    assert all(isinstance(command, Command) for command in commands)
    assert all(command.reason for command in commands if command.action == "skip")


def test_a_run_of_a_page_reports_each_command_and_the_failure_with_its_output(tmp_path, capsys):
    page = tmp_path / "page.md"
    page.write_text(
        "Intro.\n\n```bash\npython -m json.tool missing.json\npython -m json.tool missing.json\n"
        "python -m json.tool README.md\n```\n<!-- ci:\nfail 2\nrun\nskip a reason\n-->\n"
    )
    assert main([str(page)]) == 1
    out = capsys.readouterr().out
    assert f"{page}:4  $ python -m json.tool missing.json\n    exit 2  " in out  # the expected failure
    assert f"=== FAILED {page}:5: exit 2, want 0" in out
    assert "can't open 'missing.json'" in out  # the tail of its output
    assert f"[skipped: a reason] {page}:6" in out
    assert "documented commands: 1 passed, 1 failed, 1 skipped, 0 ran once for an earlier page, in" in out


def test_the_fresh_copy_holds_the_tracked_files_older_than_the_install_and_the_venv(tmp_path):
    copy = fresh_copy(REPO, tmp_path)
    assert (copy / "pyproject.toml").read_text() == (REPO / "pyproject.toml").read_text()
    assert not (copy / "lit_offpolicy.egg-info").exists()  # built by the install, not tracked
    assert (copy / ".venv" / "bin" / "lit-offpolicy").is_file()
    stamp = REPO / ".venv" / ".installed-cpu"  # `make demo` must not reinstall
    assert (copy / "Makefile").stat().st_mtime < stamp.stat().st_mtime


def test_a_command_past_its_time_limit_is_killed_with_the_processes_under_it(tmp_path):
    grandchild = ["sleep", "30.0471"]  # a duration no other process uses
    command = Command("p.md", 1, f"bash -c '{shlex.join(grandchild)} & {shlex.join(grandchild)}'", "run")
    code, cost, output = run_command(command, tmp_path, dict(os.environ), timeout=1)
    assert code == 124 and output.endswith("(killed after 1 s)")
    time.sleep(0.5)
    assert not [p for p in psutil.process_iter(["cmdline"]) if p.info["cmdline"] == grandchild]


def test_a_background_command_runs_beside_the_page_and_ends_with_it(tmp_path, capsys):
    """A page's server (`... &`) is started, left running for the next commands, then its whole process
    group ends with the page; one that exits before the page is done fails, with its output."""
    port = free_port()
    # the page's last command waits until the failing background command has exited (a loaded machine
    # may not even have started it when a quick command ends)
    gone = tmp_path / "gone.py"
    gone.write_text(
        "import psutil, time\ndeadline = time.monotonic() + 60\n"
        "def running():\n"
        "    return [p for p in psutil.process_iter(['cmdline', 'status'])\n"
        "            if 'missing.json' in (p.info['cmdline'] or []) and p.info['status'] != 'zombie']\n"
        "while running() and time.monotonic() < deadline:\n    time.sleep(0.05)\n"
    )
    page = tmp_path / "page.md"
    page.write_text(
        f"```bash\npython -m http.server {port} --bind 127.0.0.1 &   # a server\n"
        f"python -m json.tool missing.json &\nexport PYTHONPATH={tmp_path}\npython -m gone\n```\n"
        "<!-- ci:\nbackground\nbackground\nrun\n-->\n"
    )
    assert main([str(page)]) == 1
    out = capsys.readouterr().out
    assert (
        f"{page}:2  $ python -m http.server {port} --bind 127.0.0.1 &\n    started in the background" in out
    )
    assert f"=== FAILED {page}:3: exit 2, want 0" in out and "can't open 'missing.json'" in out
    assert "documented commands: 2 passed, 1 failed, 0 skipped" in out
    leftover = [p for p in psutil.process_iter(["cmdline"]) if str(port) in (p.info["cmdline"] or [])]
    assert not leftover


@pytest.mark.parametrize(
    ("block", "marks", "message"),
    [
        ("python -m http.server &", "run", "ends with `&` is marked `background`, got 'run'"),
        ("python -m http.server", "background", "`background` only for a command ending with `&`"),
    ],
)
def test_background_is_the_mark_of_a_command_ending_with_an_ampersand(block, marks, message):
    with pytest.raises(MarkError, match=message):
        extract(f"```bash\n{block}\n```\n<!-- ci: {marks} -->\n", "p.md")


@pytest.mark.parametrize("jobs", ["1", "2"])
def test_first_commands_two_pages_share_run_once_and_the_later_page_starts_from_their_files(
    tmp_path, capsys, jobs
):
    """Two at a time too: the second page waits for the first, whose commands it begins with."""
    first, second = tmp_path / "first.md", tmp_path / "second.md"
    make_zip = "python -m tarfile -c out.tar README.md"
    first.write_text(f"```bash\n{make_zip}\n```\n<!-- ci: run -->\n")
    second.write_text(f"```bash\n{make_zip}\npython -m tarfile -l out.tar\n```\n<!-- ci:\nrun\nrun\n-->\n")
    assert main([str(first), str(second), "--jobs", jobs]) == 0
    out = capsys.readouterr().out
    assert f"[ran for {first}:2] {second}:2  $ {make_zip}" in out
    assert f"{second}:3  $ python -m tarfile -l out.tar\n    exit 0" in out
    assert "2 passed, 0 failed, 0 skipped, 1 ran once for an earlier page" in out


def test_a_page_s_copy_keeps_a_relative_link_to_a_place_beside_it(tmp_path):
    """HFExport leaves ``outputs/sft-tiny`` a relative link into ``outputs/sft-tiny.runs/``: the copy of a
    page's files for a later page keeps it working (copytree had taken it for dangling and left it out)."""
    source, target = tmp_path / "page", tmp_path / "later"
    (source / "outputs" / "sft-tiny.runs" / "20261129-051200").mkdir(parents=True)
    (source / "outputs" / "sft-tiny.runs" / "20261129-051200" / "config.json").write_text("{}")
    (source / "outputs" / "sft-tiny").symlink_to("sft-tiny.runs/20261129-051200")
    _copy_tree(source, target)
    assert (target / "outputs" / "sft-tiny" / "config.json").read_text() == "{}"
    assert (target / "outputs" / "sft-tiny").resolve().is_relative_to(target.resolve())
