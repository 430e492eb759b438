"""benchmarks/learning/recipe_learning.py's verdict: a recipe learns iff its reward and its val/accuracy
rise."""

import pytest

from benchmarks.learning.recipe_learning import Result, passes, start_end


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
    from benchmarks.learning.recipe_learning import main

    with pytest.raises(SystemExit) as stop:
        main(option)
    assert stop.value.code == 2
    (line,) = [line for line in capsys.readouterr().err.splitlines() if "error:" in line]
    assert f"argument {option[0]}: '{option[1]}': allowed values: a whole number of at least 1" in line


def test_a_work_directory_that_is_a_file_or_holds_a_run_is_refused_in_one_line(tmp_path, capsys):
    from benchmarks.learning.recipe_learning import main

    (tmp_path / "file").write_text("")
    (tmp_path / "earlier" / "judge").mkdir(parents=True)
    for work, message in [("file", "not a directory"), ("earlier", "already holds a run of judge")]:
        with pytest.raises(SystemExit) as stop:
            main(["--recipes", "judge", "code", "--work", str(tmp_path / work)])
        assert stop.value.code == 2
        assert message in capsys.readouterr().err
