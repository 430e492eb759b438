"""``lit-offpolicy prepare-data gsm8k``: a GSM8K file the user has, as train/val parquet in verl's schema.

GSM8K's public layout (the jsonl files of the original release, or the parquet of its ``main``
configuration) has a ``question`` and an ``answer`` whose worked solution ends in ``#### <number>``.
Each row becomes verl's layout, which ``PromptDataModule`` reads with
``answer_key: reward_model.ground_truth``:

- ``data_source``: ``"openai/gsm8k"``;
- ``prompt``: one user message, the question and an instruction to end with ``#### <answer>``;
- ``ability``: ``"math"``;
- ``reward_model``: ``{"style": "rule", "ground_truth": <the number after ####, commas removed>}``;
- ``extra_info``: ``{"split", "index", "question", "answer"}`` (the original fields).

Nothing is downloaded.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from lit_offpolicy.core.files import give_default_mode

DATA_SOURCE = "openai/gsm8k"
INSTRUCTION = 'Solve it step by step, then give the final number on a last line as "#### <answer>".'
FINAL_ANSWER = "####"


def final_answer(solution: str) -> str | None:
    """The number after the last ``####`` of a GSM8K solution, without thousands separators; None
    when there is no ``####`` or nothing after it."""
    if FINAL_ANSWER not in solution:
        return None
    answer = solution.rsplit(FINAL_ANSWER, 1)[1].strip().replace(",", "")
    return answer or None


def read_gsm8k(path: str | Path) -> list[dict]:
    """The ``question``/``answer`` rows of a GSM8K jsonl or parquet file; a bad row raises a
    ``ValueError`` naming the file and the row."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"prepare-data gsm8k: {path} is not a file")
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        rows = pq.read_table(path).to_pylist()
    elif path.suffix == ".jsonl":
        rows = []
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as error:
                    raise ValueError(f"{path}, line {number}: not valid JSON ({error})") from None
    else:
        raise ValueError(f"prepare-data gsm8k: {path} must end in .jsonl or .parquet")
    for number, row in enumerate(rows, start=1):
        where = f"{path}, row {number}"
        if not isinstance(row, dict) or not isinstance(row.get("question"), str):
            raise ValueError(f"{where}: expected an object with a 'question' string, got {row!r:.80}")
        if not isinstance(row.get("answer"), str) or final_answer(row["answer"]) is None:
            raise ValueError(f"{where}: the 'answer' must be a solution ending in '#### <number>'")
    return rows


def verl_row(row: dict, split: str, index: int) -> dict:
    """One GSM8K row in verl's schema (see the module docstring)."""
    return {
        "data_source": DATA_SOURCE,
        "prompt": [{"role": "user", "content": f"{row['question']}\n{INSTRUCTION}"}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": final_answer(row["answer"])},
        "extra_info": {"split": split, "index": index, "question": row["question"], "answer": row["answer"]},
    }


def prepare_gsm8k(
    input_path: str | Path,
    output_dir: str | Path,
    val_input: str | Path | None = None,
    val_size: int = 256,
    seed: int = 0,
    overwrite: bool = False,
) -> dict[str, Path]:
    """Write ``train.parquet`` and ``val.parquet`` under ``output_dir``. Validation is ``val_input``
    when given, otherwise ``val_size`` rows of ``input_path`` held out at random (seeded); returns
    the two paths. Existing files are replaced only with ``overwrite``."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    output_dir = Path(output_dir)
    paths = {split: output_dir / f"{split}.parquet" for split in ("train", "val")}
    existing = [str(path) for path in paths.values() if path.exists()]
    if existing and not overwrite:
        raise ValueError(f"prepare-data gsm8k: {existing[0]} exists; pass --overwrite to replace it")
    rows = read_gsm8k(input_path)
    if val_input is not None:
        train, val = rows, read_gsm8k(val_input)
    else:
        if not 0 < val_size < len(rows):
            raise ValueError(
                f"prepare-data gsm8k: --val-size {val_size} must be between 1 and {len(rows) - 1} (the rows "
                f"of {input_path} less one), or give --val-input"
            )
        order = list(range(len(rows)))
        random.Random(seed).shuffle(order)
        held_out = set(order[:val_size])
        train = [row for i, row in enumerate(rows) if i not in held_out]
        val = [row for i, row in enumerate(rows) if i in held_out]
    output_dir.mkdir(parents=True, exist_ok=True)
    for split, split_rows in (("train", train), ("val", val)):
        table = pa.Table.from_pylist([verl_row(row, split, index) for index, row in enumerate(split_rows)])
        temporary = paths[split].with_suffix(".parquet.tmp")
        pq.write_table(table, temporary)
        give_default_mode(temporary)
        temporary.replace(paths[split])  # atomic: a killed run leaves the old file or the new one
    return paths
