"""benchmarks/learning/async_matrix.py's pure parts: start/end of a reward curve, the pass rule, the table,
the cells.

No training run here: the matrix itself runs in CI (.ci/run, ``--quick``).
"""

import os

import pytest

from benchmarks.learning import async_matrix
from benchmarks.learning.async_matrix import QUICK_CELLS, cells_of, failing, parse, passes, start_end, table


def test_start_is_steps_0_to_4_and_end_the_last_10():
    curve = [(step, float(step)) for step in range(100)]
    assert start_end(curve) == (2.0, 94.5)  # mean of 0..4; mean of 90..99 (sums of small integers: exact)
    shuffled = curve[50:] + curve[:50]
    assert start_end(shuffled) == (2.0, 94.5)  # by step, not by order in the log


def test_start_end_needs_the_first_steps():
    with pytest.raises(ValueError, match="reward/mean"):
        start_end([(10, 0.5), (11, 0.6)])


def test_a_cell_passes_only_if_reward_rose():
    assert passes(0.4, 0.41)
    assert not passes(0.4, 0.4)
    assert not passes(0.4, 0.0)  # issue #38: collapsed to reward 0
    assert not passes(None, None)  # crashed


RESULTS = {
    ("sync", 0.7, "none"): {0: (0.412, 0.674), 1: (0.4, 0.5)},
    ("async_k1", 1.0, "seq_is_rs"): {0: (0.395, 0.0), 1: (None, None)},
}


def test_table_has_a_row_per_cell_and_start_to_end_per_seed():
    lines = table(RESULTS, [0, 1]).splitlines()
    assert lines[0] == "| mode | temperature | correction | seed 0 | seed 1 | passed |"
    assert lines[1] == "|---|---:|---|---|---|---:|"
    assert lines[2] == "| sync | 0.7 | none | 0.412 → 0.674 | 0.400 → 0.500 | 2/2 |"
    assert lines[3] == "| async_k1 | 1.0 | seq_is_rs | 0.395 → 0.000 | crashed | 0/2 |"
    assert len(lines) == 4


def test_failing_names_the_cells_and_seeds():
    assert failing(RESULTS) == ["async_k1/T1.0/seq_is_rs (seed 0, 1)"]
    assert failing({("sync", 0.7, "none"): {0: (0.1, 0.2)}}) == []


def test_the_default_matrix_is_3_modes_by_2_temperatures_by_2_corrections():
    args = parse([])
    cells = cells_of(args)
    assert args.seeds == [0, 1, 2] and args.steps == 100 and args.jobs == 1 and not args.no_record
    assert len(cells) == 12 and len(set(cells)) == 12
    assert {mode for mode, _, _ in cells} == {"sync", "async_k1", "async_k2"}
    assert {t for _, t, _ in cells} == {0.7, 1.0}
    assert {c for _, _, c in cells} == {"none", "seq_is_rs"}
    assert cells[0] == ("sync", 0.7, "none") and cells[-1] == ("async_k2", 1.0, "seq_is_rs")


def test_quick_is_seed_0_and_the_four_cells_that_matter_most():
    args = parse(["--quick", "--seeds", "5", "6", "--steps", "3", "--modes", "sync"])
    assert args.seeds == [0] and args.steps == 100
    assert (
        cells_of(args)
        == QUICK_CELLS
        == [
            ("sync", 0.7, "none"),
            ("async_k1", 0.7, "none"),
            ("async_k2", 0.7, "none"),
            ("async_k1", 1.0, "none"),
        ]
    )


def test_the_docstring_gives_both_commands():
    doc = async_matrix.__doc__
    assert len(doc.splitlines()) <= 25
    assert (
        "python -m benchmarks.learning.async_matrix  " in doc
        and "python -m benchmarks.learning.async_matrix --quick" in doc
    )


def test_the_entry_counts_cells_passed_in_every_seed_and_fits_the_results_table():
    import json

    import torch

    from benchmarks.learning.async_matrix import result_entry
    from benchmarks.results_table import table

    args = parse(["--seeds", "0", "1", "--modes", "sync", "async_k1", "--temperatures", "0.7"])
    cells = cells_of(args)
    assert len(cells) == 4
    outcome = {
        (cell, seed): {"start": 0.4, "end": 0.1 if cell[0] == "async_k1" and seed else 0.6, "seconds": 90.0}
        for cell in cells
        for seed in args.seeds
    }
    results = {
        cell: {s: (outcome[cell, s]["start"], outcome[cell, s]["end"]) for s in args.seeds} for cell in cells
    }
    threads = torch.get_num_threads()
    entry = result_entry(cells, args, outcome, failing(results), "python -m benchmarks.learning.async_matrix")
    assert torch.get_num_threads() == threads  # the caller's threads are left as they were
    assert (entry["name"], entry["unit"], entry["ours"], entry["baseline"], entry["ratio"]) == (
        "async_learning_matrix", "cells", 2.0, 4.0, 0.5
    )  # fmt: skip
    assert entry["repeats"] == 2 and "(1 threads)" in entry["machine"]
    assert entry["cells"]["async_k1/T0.7/none"]["1"]["end"] == 0.1
    json.dumps(entry)  # results.json holds it
    device = f"CPU, {os.cpu_count()} cores"
    assert (
        f"| `async_learning_matrix` | {device} | cells | 2 | 4 | 0.5 | 2 | target ≥ 1 (not met) |"
        in table([entry])
    )


def fake_run_cell(cell, seed, sft, work, steps):
    """Reward rises except in async_k2 at T 0.7, seed 0 (no training)."""
    end = 0.0 if cell[:2] == ("async_k2", 0.7) and seed == 0 else 0.6
    return {"start": 0.4, "end": end, "passed": passes(0.4, end), "seconds": 1.0}


def test_main_exits_1_naming_the_failing_cells_and_records_only_full_runs(tmp_path, monkeypatch, capsys):
    recorded = []
    monkeypatch.setattr(async_matrix, "run_cell", fake_run_cell)
    monkeypatch.setattr(async_matrix, "record", recorded.extend)
    common = ["--sft-dir", str(tmp_path), "--work", str(tmp_path / "work")]
    assert async_matrix.main(["--quick", *common]) == 1
    out = capsys.readouterr().out
    assert "=== async_matrix FAILED: reward did not rise in async_k2/T0.7/none (seed 0)" in out
    assert "| async_k2 | 0.7 | none | 0.400 → 0.000 | 0/1 |" in out
    assert recorded == []  # --quick never records
    assert async_matrix.main(["--modes", "sync", *common, "--no-record"]) == 0
    assert "reward rose in all 4 cells" in capsys.readouterr().out and recorded == []
    assert async_matrix.main(["--modes", "sync", "async_k2", *common]) == 1
    (entry,) = recorded
    assert (entry["ours"], entry["baseline"]) == (6.0, 8.0)
    assert (
        entry["command"]
        == f"python -m benchmarks.learning.async_matrix --modes sync async_k2 {' '.join(common)}"
    )
