"""The real code-benchmark problems of ``tests/fixtures/code_benchmarks/`` (README.md there), by layout."""

from __future__ import annotations

import json
from pathlib import Path

FIXTURES = Path(__file__).parents[1] / "fixtures" / "code_benchmarks"
COLUMNS = {"mbpp": ("test_list", "test_setup_code"), "humaneval": ("test", "entry_point")}
"""Each layout's fixture file (``<layout>.jsonl``) and the columns ``CodeExecutionReward`` reads from it."""


def problems(layout: str) -> list[dict]:
    """The layout's rows, each with ``solution``: its canonical solution as a completion."""
    return [json.loads(line) for line in (FIXTURES / f"{layout}.jsonl").read_text().splitlines()]


def reward_problem(layout: str, row: dict, prompt: bool = True) -> dict:
    """``row`` as the data module hands it to the reward (``data.prompt_key: prompt``): HumanEval's prompt
    (MBPP's rows have none; ``prompt=False``: none either), and the layout's columns under ``columns``."""
    text = row.get("prompt", "") if prompt else ""
    return {"prompt": text, "answer": "", "columns": {name: row[name] for name in COLUMNS[layout]}}
