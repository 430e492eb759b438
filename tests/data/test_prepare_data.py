"""``lit-offpolicy prepare-data gsm8k``: a GSM8K-layout file (our own problems,
tests/fixtures/gsm8k_tiny.jsonl) as verl-schema train/val parquet that the data module reads."""

from __future__ import annotations

import json

import pyarrow.parquet as pq
import pytest
from helpers import FIXTURES

from lit_offpolicy.cli import main
from lit_offpolicy.data import PromptDataModule
from lit_offpolicy.data.prepare import INSTRUCTION, final_answer, prepare_gsm8k
from lit_offpolicy.models import build_tokenizer

FIXTURE = FIXTURES / "gsm8k_tiny.jsonl"


@pytest.mark.parametrize(
    ("solution", "answer"),
    [
        ("3 * 4 = 12\n#### 12", "12"),
        ("#### 1,234", "1234"),
        ("a #### 5 then #### 7 ", "7"),  # the last one
        ("#### -3", "-3"),
        ("no marker 12", None),
        ("ends with ####   ", None),
    ],
)
def test_final_answer_is_the_number_after_the_last_marker(solution, answer):
    assert final_answer(solution) == answer


def test_gsm8k_becomes_verl_parquet_with_a_seeded_held_out_split(tmp_path):
    originals = [json.loads(line) for line in FIXTURE.read_text().splitlines()]
    paths = prepare_gsm8k(FIXTURE, tmp_path / "gsm8k", val_size=8, seed=3)
    train, val = (pq.read_table(paths[split]).to_pylist() for split in ("train", "val"))
    assert (len(train), len(val)) == (56, 8)
    questions = [row["extra_info"]["question"] for row in train + val]
    assert sorted(questions) == sorted(row["question"] for row in originals), "every row once"
    by_question = {row["question"]: row for row in originals}
    for split, rows in (("train", train), ("val", val)):
        for index, row in enumerate(rows):
            original = by_question[row["extra_info"]["question"]]
            assert row["data_source"] == "openai/gsm8k" and row["ability"] == "math"
            assert row["prompt"] == [{"role": "user", "content": f"{original['question']}\n{INSTRUCTION}"}]
            expected = original["answer"].rsplit("####", 1)[1].strip()
            assert row["reward_model"] == {"style": "rule", "ground_truth": expected}
            assert row["extra_info"] == {
                "split": split,
                "index": index,
                "question": original["question"],
                "answer": original["answer"],
            }
    again = prepare_gsm8k(FIXTURE, tmp_path / "again", val_size=8, seed=3)
    assert pq.read_table(again["val"]).to_pylist() == val, "the same seed holds out the same rows"
    other = prepare_gsm8k(FIXTURE, tmp_path / "other", val_size=8, seed=4)
    assert pq.read_table(other["val"]).to_pylist() != val

    tokenizer = build_tokenizer()
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    data = PromptDataModule(
        train_files=[str(paths["train"])],
        val_files=[str(paths["val"])],
        answer_key="reward_model.ground_truth",
        max_prompt_length=512,
        batch_size=4,
    )
    data.set_tokenizer(tokenizer)
    data.setup("fit")
    assert [p["answer"] for p in data.val_problems] == [row["reward_model"]["ground_truth"] for row in val]
    assert data.val_problems[0]["columns"]["data_source"] == "openai/gsm8k"


def test_a_separate_validation_file(tmp_path):
    lines = FIXTURE.read_text().splitlines()
    (tmp_path / "train.jsonl").write_text("\n".join(lines[:50]) + "\n")
    (tmp_path / "test.jsonl").write_text("\n".join(lines[50:]) + "\n")
    paths = prepare_gsm8k(tmp_path / "train.jsonl", tmp_path / "out", val_input=tmp_path / "test.jsonl")
    assert pq.read_metadata(paths["train"]).num_rows == 50 and pq.read_metadata(paths["val"]).num_rows == 14


def _fails(args: list[str], capsys) -> str:
    with pytest.raises(SystemExit) as exit_info:
        main(args)
    assert exit_info.value.code == 2
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err
    (line,) = captured.err.strip().splitlines()
    return line


def test_the_cli_writes_refuses_to_overwrite_and_names_bad_rows(tmp_path, capsys):
    out = tmp_path / "out"
    main(["prepare-data", "gsm8k", "--input", str(FIXTURE), "--output", str(out), "--val-size", "4"])
    printed = capsys.readouterr().out
    assert f"wrote {out / 'train.parquet'} (train)" in printed and "reward_model.ground_truth" in printed
    again = ["prepare-data", "gsm8k", "--input", str(FIXTURE), "--output", str(out)]
    assert _fails(again, capsys) == (
        f"lit-offpolicy: error: prepare-data gsm8k: {out / 'train.parquet'} exists; "
        "pass --overwrite to replace it"
    )
    error = _fails([*again, "--overwrite"], capsys)  # 256 rows held out by default, of 64
    assert error.endswith(
        "--val-size 256 must be between 1 and 63 (the rows of " + f"{FIXTURE} less one), or give --val-input"
    )
    main([*again, "--overwrite", "--val-size", "10"])
    assert pq.read_metadata(out / "val.parquet").num_rows == 10
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"question": "1+1?", "answer": "2"}) + "\n")
    error = _fails(["prepare-data", "gsm8k", "--input", str(bad), "--output", str(tmp_path / "x")], capsys)
    assert (
        error
        == f"lit-offpolicy: error: {bad}, row 1: the 'answer' must be a solution ending in '#### <number>'"
    )
    error = _fails(["prepare-data", "math", "--input", str(bad), "--output", str(tmp_path / "x")], capsys)
    assert error.startswith("lit-offpolicy: error: prepare-data: argument dataset: invalid choice: 'math'")
