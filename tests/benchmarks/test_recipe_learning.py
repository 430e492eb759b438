"""benchmarks/learning/recipe_learning.py: its verdict (a recipe learns iff its reward and its val/accuracy
rise), its arguments and its Ctrl-C."""

import os
import signal
import subprocess
import sys
import time

import psutil
import pytest
from helpers import REPO

from benchmarks.learning.recipe_learning import Result, main, passes, start_end


def test_start_and_end_are_the_means_of_the_first_and_last_five_steps():
    curve = [(step, float(step)) for step in range(12)]  # out of order on purpose below
    assert start_end(list(reversed(curve))) == (2.0, 9.0)


def test_a_curve_too_short_for_a_start_and_an_end_is_named():
    with pytest.raises(RuntimeError, match="9 reward/mean points"):
        start_end([(step, 0.0) for step in range(9)])


@pytest.mark.parametrize(
    ("result", "learned"),
    [
        (Result(0.80, 0.90, 0.44, 0.59), True),
        (Result(0.80, 0.90, 0.44, 0.44), False),  # the reward rose, greedy accuracy did not
        (Result(0.80, 0.79, 0.44, 0.59), False),  # accuracy rose, the reward did not
        (None, False),  # the run failed
    ],
)
def test_a_run_passes_only_where_reward_and_val_accuracy_both_rise(result, learned):
    assert passes(result) is learned


@pytest.mark.parametrize("option", [["--jobs", "0"], ["--steps", "-1"], ["--jobs", "two"]])
def test_a_count_below_one_is_refused_in_one_line_before_anything_runs(option, capsys):
    with pytest.raises(SystemExit) as stop:
        main(option)
    assert stop.value.code == 2
    (line,) = [line for line in capsys.readouterr().err.splitlines() if "error:" in line]
    assert f"argument {option[0]}: '{option[1]}': allowed values: a whole number of at least 1" in line


def test_a_work_directory_that_is_a_file_or_holds_a_run_is_refused_in_one_line(tmp_path, capsys):
    (tmp_path / "file").write_text("")
    (tmp_path / "earlier" / "judge").mkdir(parents=True)
    for work, message in [("file", "not a directory"), ("earlier", "already holds a run of judge")]:
        with pytest.raises(SystemExit) as stop:
            main(["--recipes", "judge", "code", "--work", str(tmp_path / work)])
        assert stop.value.code == 2
        assert message in capsys.readouterr().err


SLEEPING_RECIPES = """
import sys
from benchmarks.learning import recipe_learning as harness
sleep = ("python", "-c", "import time; print('asleep', flush=True); time.sleep(120)")
harness.RECIPES = {name: harness.Recipe(name, (sleep,), "unused.yaml", "logs") for name in ("code", "judge")}
sys.exit(harness.main(["--jobs", "2", "--quick", "--work", sys.argv[1]]))
"""


@pytest.mark.slow  # a process and its two children
def test_ctrl_c_to_the_harness_alone_ends_its_commands_and_it_with_one_line(tmp_path):
    """SIGINT to the harness only (not its process group): the recipes' running commands get it too,
    none starts after, and the harness exits 130 with one line."""
    harness = subprocess.Popen(
        [sys.executable, "-c", SLEEPING_RECIPES, str(tmp_path / "work")],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    try:
        deadline = time.monotonic() + 60
        while len(psutil.Process(harness.pid).children()) < 2:
            assert time.monotonic() < deadline and harness.poll() is None, harness.communicate()[0]
            time.sleep(0.1)
        children = psutil.Process(harness.pid).children()
        os.kill(harness.pid, signal.SIGINT)
        output = harness.communicate(timeout=60)[0]
    finally:  # a failing run leaves nothing behind
        for process in psutil.Process(harness.pid).children() if harness.poll() is None else []:
            process.kill()
        harness.kill()
    assert harness.returncode == 130, output
    assert output.splitlines()[-1] == f"=== recipe_learning interrupted; runs so far in {tmp_path / 'work'}"
    assert "Traceback" not in output
    assert not [child for child in children if child.is_running() and child.status() != "zombie"]
