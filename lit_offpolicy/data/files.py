"""Prompt files: JSONL or Parquet rows with a prompt and an answer column (TRL's and verl's layouts,
dotted keys into nested fields), read lazily, bad rows raised or skipped, and several files mixed."""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from pathlib import Path

from lit_offpolicy.core.checks import check_choice
from lit_offpolicy.data.tasks import Problem

FILE_FORMATS = (".jsonl", ".parquet")

ON_BAD_DATA = ("error", "skip")


def mix_files(
    per_file: list[list[Problem]], weights: list[float], size: int | None, seed: int
) -> list[Problem]:
    """Training rows from several files in proportion to ``weights``: of ``size`` rows (None: as many
    as the files hold together) file i gives round(size · w_i / Σw), its rows in a seeded random
    order, repeated where the file has fewer (as ``interleave_datasets`` with probabilities gives
    in expectation, but exactly)."""
    size = sum(len(problems) for problems in per_file) if size is None else size
    total = sum(weights)
    mixed = []
    for index, (problems, weight) in enumerate(zip(per_file, weights, strict=True)):
        count = round(size * weight / total)
        if count and not problems:
            raise ValueError(f"train_files[{index}] has no rows but train_file_weights[{index}]={weight}")
        order = list(range(len(problems)))
        random.Random(f"mix/{seed}/{index}").shuffle(order)
        mixed += [problems[order[i % len(order)]] for i in range(count)]
    return mixed


def read_problems(path: str | Path, prompt_key: str = "prompt", answer_key: str = "answer") -> list[Problem]:
    """Prompt/answer rows of a JSONL or Parquet file (by suffix); answers are kept as strings.

    A bad row raises a ``ValueError`` naming the file and line; :func:`read_file` can skip them.
    """
    return read_file(path, prompt_key, answer_key, on_bad_data="error")[0]


def read_file(
    path: str | Path, prompt_key: str = "prompt", answer_key: str = "answer", on_bad_data: str = "error"
) -> tuple[list[Problem], list[str]]:
    """The good rows of a prompt file, and one message (file, line, what is wrong) per skipped bad row.

    ``on_bad_data="error"`` raises the first bad row's message as a ``ValueError`` instead.
    """
    check_choice("on_bad_data", on_bad_data, ON_BAD_DATA)
    path = Path(path)
    problems, bad = [], []
    for where, row in _rows(path, prompt_key, answer_key):
        try:
            problems.append(_problem(row, prompt_key, answer_key, path, where))
        except ValueError as error:
            if on_bad_data == "error":
                raise
            bad.append(str(error))
    return problems, bad


def check_first_row(
    path: str | Path, prompt_key: str = "prompt", answer_key: str = "answer", check_row: bool = True
) -> None:
    """Raise what ``read_file`` would about a file that is missing, is not a file, has no rows, or
    (``check_row``) whose first row is bad, reading only that row (a start-up check, before a model
    loads). ``check_row=False`` where bad rows are to be skipped."""
    path = Path(path)
    first = next(iter(_rows(path, prompt_key, answer_key)), None)
    if first is None:
        raise ValueError(f"prompt file {path} has no rows")
    if check_row:
        _problem(first[1], prompt_key, answer_key, path, first[0])


def _rows(path: Path, prompt_key: str, answer_key: str) -> Iterator[tuple[str, object]]:
    """A prompt file's rows, each with where it is ("line 3", "row 3"), read lazily."""
    suffix = check_choice(f"file suffix of {path}", path.suffix, FILE_FORMATS)
    if path.is_dir():
        raise IsADirectoryError(f"prompt file {path} is a directory; name the files in it")
    if not path.is_file():
        raise FileNotFoundError(f"prompt file {path} does not exist")
    return _read_jsonl(path) if suffix == ".jsonl" else _read_parquet(path, [prompt_key, answer_key])


class _Unreadable(str):
    """A JSONL line that is not UTF-8 or not JSON: the reason, raised when the row is read."""


def _read_jsonl(path: Path) -> Iterator[tuple[str, object]]:
    with path.open("rb") as file:
        for number, raw in enumerate(file, start=1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as error:
                yield f"line {number}", _Unreadable(f"not valid UTF-8 ({error})")
                continue
            if not line.strip():
                continue
            try:
                yield f"line {number}", json.loads(line)
            except json.JSONDecodeError as error:
                yield f"line {number}", _Unreadable(f"not valid JSON ({error})")


def _read_parquet(path: Path, columns: list[str]) -> Iterator[tuple[str, object]]:
    """The rows with all their columns, read batch by batch; a missing one of ``columns`` (the
    prompt's and the answer's) raises before any row."""
    try:
        import pyarrow.parquet as pq
    except ImportError as error:
        raise ImportError(f"reading {path} needs pyarrow; install it or convert the file to JSONL") from error
    schema_names = pq.read_schema(path).names
    # a dotted key names a field inside a struct column: read that column
    columns = list(dict.fromkeys(c if c in schema_names else c.split(".")[0] for c in columns))
    missing = [column for column in columns if column not in schema_names]
    if missing:
        raise ValueError(f"{path}: no column {missing[0]!r}; columns: {', '.join(schema_names)}")
    return _parquet_batches(pq.ParquetFile(path))


def _parquet_batches(file) -> Iterator[tuple[str, object]]:
    index = 0
    for batch in file.iter_batches():
        for row in batch.to_pylist():
            index += 1
            yield f"row {index}", row


def _problem(row: object, prompt_key: str, answer_key: str, path: Path, where: str) -> Problem:
    if isinstance(row, _Unreadable):
        raise ValueError(f"{path}, {where}: {row}")
    if not isinstance(row, dict):
        raise ValueError(f"{path}, {where}: expected a JSON object, got {type(row).__name__}")
    prompt, answer = (_field(row, key, f"{path}, {where}") for key in (prompt_key, answer_key))
    if isinstance(prompt, list):
        _check_messages(prompt, f"{path}, {where}: field {prompt_key!r}")
    elif not isinstance(prompt, str):
        raise ValueError(
            f"{path}, {where}: field {prompt_key!r} must be a string or a list of chat messages, "
            f"got {prompt!r}"
        )
    elif not prompt.strip():
        raise ValueError(f"{path}, {where}: field {prompt_key!r} is empty")
    if isinstance(answer, bool) or not isinstance(answer, (str, int, float)):
        raise ValueError(f"{path}, {where}: field {answer_key!r} must be a string or number, got {answer!r}")
    columns = {name: value for name, value in row.items() if name != prompt_key}
    return {"prompt": prompt, "answer": str(answer), "columns": columns}


CHAT_ROLES = ("system", "user", "assistant", "tool")


def _check_messages(messages: list, where: str) -> None:
    """A chat prompt: a non-empty list of ``{"role": ..., "content": str}`` with known roles."""
    if not messages:
        raise ValueError(f"{where} is an empty list of messages")
    for index, message in enumerate(messages):
        role = message.get("role") if isinstance(message, dict) else None
        if role not in CHAT_ROLES or not isinstance(message.get("content"), str):
            allowed = ", ".join(repr(r) for r in CHAT_ROLES)
            raise ValueError(
                f"{where}, message {index}: expected {{'role': one of {allowed}, 'content': a string}}, "
                f"got {message!r}"
            )


def _field(row: dict, key: str, where: str) -> object:
    """``row[key]``; a dotted key (``reward_model.ground_truth``, verl's layout) that is not itself a
    field reaches into nested objects."""
    if key in row:
        return row[key]
    value: object = row
    for part in key.split("."):
        if not isinstance(value, dict) or part not in value:
            raise ValueError(f"{where}: missing field {key!r}")
        value = value[part]
    return value
